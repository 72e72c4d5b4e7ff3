"""Matmul precision of the stream forms: ``precision="fp32"`` (exact, the default) or ``"bf16"``.

At batch 100 a stream step is bound by arithmetic, and on CPUs with AVX512-BF16 or AMX (and on
CUDA GPUs) bfloat16 matmuls run several times faster than float32 ones. ``bf16`` applies to the
weight matmuls of the stream forms that opt in (a mechanism's ``stream_precisions``; the block's
MLP): weights are snapshotted in bfloat16, each input is rounded right before the matmul, and the
product comes back in the activations' dtype, where the bias is added. A softmax layer's key/value
ring is kept in bfloat16 too (each entry rounded once, never accumulated into). Everything that
accumulates stays in the model's dtype (residual stream, norms, running sums: a bfloat16 sum of
1000 tokens would stop moving), so errors do not build up over an episode; actions are close to
fp32's but not bit-exact, which is why fp32 stays the default.
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
    """``w`` for ``precision``: detached (fp32: the parameter itself, so in-place updates show), or a
    bfloat16 copy."""
    if w is None:
        return None
    dtype = PRECISIONS[check_precision(precision)]
    return w.detach() if dtype is None else w.detach().to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the matmul in ``w``'s dtype and the result, bias added, in ``x``'s dtype."""
    if w.dtype == x.dtype:
        return F.linear(x, w, b)
    y = F.linear(x.to(w.dtype), w).to(x.dtype)
    return y if b is None else y.add_(b)


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether bfloat16 matmuls are native on ``device`` (CPU: AVX512-BF16 or AMX; other devices are
    assumed to be); without it oneDNN emulates them, slower than float32."""
    if torch.device(device).type != "cpu":
        return True
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(c()) for c in checks if c is not None)
