"""Matmul precision of the stream forms: ``precision="fp32"`` (exact, the default) or ``"bf16"``.

At batch 100 a stream step is bound by arithmetic: its matmuls run near the CPU's float32 peak, and
the step already does the fewest multiply-adds its model allows. What is left is cheaper arithmetic:
on CPUs with AVX512-BF16 or AMX (and on CUDA GPUs), bfloat16 matmuls run several times faster than
float32 ones.

``bf16`` applies to the matmuls of the stream forms that opt in (``stream_precisions`` of a
mechanism; the block's MLP). Their weights are snapshotted in bfloat16, each input is rounded to
bfloat16 right before the matmul, and the product comes back in the activations' own dtype, where the
bias is added. A softmax layer's key/value ring is kept in bfloat16 too: each key and value is
rounded once, when written, and never accumulated into; at batch 100 the attention reads the whole
ring every step, so its size is what that attention costs (scores and softmax stay in the model's
dtype). Everything that accumulates stays in the model's dtype: the residual stream, layer norms,
the running sums of primal and linear layers (a float32 sum of 1000 tokens stays exact where a
bfloat16 one would stop moving), the embeddings and the action head. So rounding errors do not build
up over an episode: each step's actions differ from fp32's by a bounded amount (the tests keep a
bound on it), but they are not bit-exact, which is why fp32 stays the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
"""name -> matmul dtype (None: the model's own, no rounding)"""


def check_precision(precision: str) -> str:
    """``precision`` itself, or a ValueError saying which names exist."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r} "
                         "(fp32: exact stream step; bf16: bfloat16 weight matmuls, faster on CPUs with AVX512-BF16/AMX)")
    return precision


def weight(w: torch.Tensor | None, precision: str) -> torch.Tensor | None:
    """A snapshot of the weight ``w`` for ``precision``: detached (fp32: the parameter itself, so
    in-place updates show), or a bfloat16 copy."""
    if w is None:
        return None
    dtype = PRECISIONS[check_precision(precision)]
    return w.detach() if dtype is None else w.detach().to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the matmul in ``w``'s dtype and the result, bias added, in ``x``'s dtype: a
    plain ``F.linear`` when they agree (fp32 snapshots), so the exact path pays nothing."""
    if w.dtype == x.dtype:
        return F.linear(x, w, b)
    y = F.linear(x.to(w.dtype), w).to(x.dtype)
    return y if b is None else y.add_(b)


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether bfloat16 matmuls are native on ``device`` (CPU: AVX512-BF16 or AMX; elsewhere CUDA
    and the like are assumed to be). Without it oneDNN emulates them, slower than float32."""
    if torch.device(device).type != "cpu":
        return True
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(c()) for c in checks if c is not None)
