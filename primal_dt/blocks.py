"""Transformer blocks and stacks whose layers each name their attention mechanism.

A stack is a list of ``LayerSpec``s, so "PrimalFormer" (every layer primal) and "Primal.+X"
(backbone X, last layer primal) are configurations (see layouts.py), not code. The stack runs
in parallel (``forward``) or recurrently (``init_state`` / ``step``), the latter threading each
layer's attention state; blocks are otherwise token-wise, so the two agree whenever every
mechanism's ``step`` agrees with its ``forward``.

For inference engines the stack also streams (``init_stream`` / ``stream_step``): each block runs
its mechanism's stream form (attention/base.py) inside the pre-norm residual, and with
``last_only`` the top block carries only the chunk's last token through its residual and MLP (the
other tokens only advance the top layer's attention state). Stream steps apply no dropout: they
are the eval-mode computation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .attention import build_attention
from .attention.base import Attention
from .attention.precision import check_precision, weight
from .attention.state import State


@dataclass
class LayerSpec:
    attention: str = "softmax"
    options: dict = field(default_factory=dict)


_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}
MLP_KEY = "block.mlp"
"""shared entry of a layer's stream state: the block's MLP weights in a reduced precision (Block.init_stream)"""


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, spec: LayerSpec, causal: bool, mlp_ratio: float = 4,
                 dropout: float = 0.1, norm: str = "pre", activation: str = "gelu", d_ff: int | None = None):
        super().__init__()
        if norm not in ("pre", "post"):
            raise ValueError(f"norm must be 'pre' or 'post', got {norm!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.norm = norm
        self.attn = build_attention(spec.attention, d_model, n_heads, causal=causal, **spec.options)
        hidden = d_ff or int(mlp_ratio * d_model)
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), _ACTIVATIONS[activation](),
                                 nn.Linear(hidden, d_model), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def _residual(self, x: torch.Tensor, attend: Callable):
        # (not ``_apply``: that name is nn.Module's hook behind .to() / .cuda() / .double())
        if self.norm == "pre":
            a, extra = attend(self.ln1(x))
            x = x + self.drop(a)
            return x + self.mlp(self.ln2(x)), extra
        a, extra = attend(x)
        x = self.ln1(x + self.drop(a))
        return self.ln2(x + self.mlp(x)), extra

    def forward(self, x, mask=None):
        return self._residual(x, lambda h: self.attn(h, mask))

    def step(self, x, state, mask=None):
        return self._residual(x, lambda h: self.attn.step(h, state, mask))

    def init_stream(self, batch: int, *, device=None, dtype=None, window: int | None = None,
                    chunk: int = 1, precision: str = "fp32") -> State:
        """The attention's stream state (Attention.init_stream); pre-norm blocks only. With a
        ``precision`` other than fp32 the state also carries the block's MLP weights in that precision
        (shared entry ``MLP_KEY``): one object per layer holds every snapshot its stream step reads."""
        if self.norm != "pre":
            raise ValueError("Block.stream_step supports pre-norm blocks (the Decision Transformer's); this block "
                             "is post-norm: use init_state / step")
        state = self.attn.init_stream(batch, device=device, dtype=dtype, window=window, chunk=chunk,
                                      precision=precision)
        if precision != "fp32":
            up, down = self.mlp[0], self.mlp[2]
            state.shared[MLP_KEY] = (weight(up.weight, precision), weight(up.bias, precision),
                                     weight(down.weight, precision), weight(down.bias, "fp32"))
        return state

    def stream_step(self, x, state, mask=None, last_only: bool = False, form: Callable | None = None):
        """Pre-norm residual around the attention's stream form: x [B, C, D] -> (y, state) with y
        [B, C, D], or [B, 1, D] for the last token when ``last_only`` (then only that token goes
        through the residual and the MLP). No dropout (eval-mode computation). ``form`` replaces the
        attention's ``stream_step`` (same signature): agents.export passes the mechanism's export form,
        so the exported graph and the stream engine share this one residual.

        This runs once per layer per environment step, where a step at batch 1 costs per operator,
        not per flop, and at batch 100 fresh [B*C, 4D] buffers cost page faults: so the layer norms
        and the MLP are called functionally (five module calls fewer), and the MLP's activation and
        the second residual are applied in place on the MLP's own fresh outputs. With a bf16 snapshot
        (``init_stream(precision="bf16")``) the hidden layer stays in bfloat16 between the two matmuls."""
        ln1, ln2 = self.ln1, self.ln2
        h = F.layer_norm(x, ln1.normalized_shape, ln1.weight, ln1.bias, ln1.eps)
        mlp = state.shared.get(MLP_KEY) if form is None else None  # (export forms: fp32 module weights)
        a, state = (form or self.attn.stream_step)(h, state, mask, last_only)
        x = (x[:, -1:] if last_only else x) + a
        act = self.mlp[1]
        h = F.layer_norm(x, ln2.normalized_shape, ln2.weight, ln2.bias, ln2.eps)
        if mlp is None:
            up, down = self.mlp[0], self.mlp[2]
            u = F.linear(h, up.weight, up.bias)
            u = u.relu_() if isinstance(act, nn.ReLU) else act(u)
            return F.linear(u, down.weight, down.bias).add_(x), state
        w1, b1, w2, b2 = mlp
        u = F.linear(h.to(w1.dtype), w1, b1)
        u = u.relu_() if isinstance(act, nn.ReLU) else act(u)
        return F.linear(u, w2).to(x.dtype).add_(b2).add_(x), state


class Stack(nn.Module):
    def __init__(self, d_model: int, n_heads: int, layers: Sequence[LayerSpec | str], causal: bool = False,
                 mlp_ratio: float = 4, dropout: float = 0.1, norm: str = "pre", activation: str = "gelu",
                 d_ff: int | None = None, final_norm: bool = True):
        super().__init__()
        if not layers:
            raise ValueError("a stack needs at least one layer")
        specs = [LayerSpec(s) if isinstance(s, str) else s for s in layers]
        self.specs = specs
        self.causal = causal
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, s, causal, mlp_ratio, dropout, norm, activation, d_ff) for s in specs
        )
        self.ln_f = nn.LayerNorm(d_model) if final_norm else nn.Identity()

    @property
    def supports_step(self) -> bool:
        return all(b.attn.causal and b.attn.supports_step for b in self.blocks)

    def forward(self, x, mask=None):
        """x [B, T, D] -> (y [B, T, D], list of per-layer aux dicts)."""
        auxes = []
        for b in self.blocks:
            x, aux = b(x, mask)
            auxes.append(aux)
        return self.ln_f(x), auxes

    def _require_step(self) -> None:
        if not self.supports_step:
            bad = [s.attention for s, b in zip(self.specs, self.blocks) if not b.attn.supports_step]
            raise ValueError(f"recurrent stepping needs a causal stack of mechanisms with a recurrent form; "
                             f"causal={self.causal}, without one: {bad}")

    def init_state(self, batch: int, device=None, dtype=None) -> list:
        self._require_step()
        return [b.attn.init_state(batch, device=device, dtype=dtype) for b in self.blocks]

    def step(self, x, states: list, mask=None):
        """Consume chunk x [B, C, D]; returns (y [B, C, D], new states)."""
        new = []
        for b, st in zip(self.blocks, states):
            x, st = b.step(x, st, mask)
            new.append(st)
        return self.ln_f(x), new

    def init_stream(self, batch: int, *, device=None, dtype=None, window: int | None = None,
                    chunk: int = 1, precision: str = "fp32") -> list:
        """Per-block stream states (Block.init_stream; ``window`` / ``chunk`` / ``precision`` as in
        Attention.init_stream). A layer whose mechanism cannot stream ``precision`` is a ValueError
        naming it, before any state is built."""
        self._require_step()
        check_precision(precision)
        bad = [f"layer {i} ({s.attention})" for i, (s, b) in enumerate(zip(self.specs, self.blocks))
               if precision not in b.attn.stream_precisions]
        if bad:
            raise ValueError(f"precision={precision!r} needs every attention layer to support it; {', '.join(bad)} "
                             f"streams in fp32 only. bf16 covers softmax and primal layers: use precision='fp32' "
                             "for this model")
        return [b.init_stream(batch, device=device, dtype=dtype, window=window, chunk=chunk, precision=precision)
                for b in self.blocks]

    def stream_step(self, x, states: list, mask=None, last_only: bool = False):
        """Consume chunk x [B, C, D] through every block's stream form; returns (y, new states) with y
        [B, C, D], or [B, 1, D] when ``last_only`` (lower blocks still pass every token on: the chunk's
        tokens feed the upper layers' states)."""
        new, top = [], len(self.blocks) - 1
        for i, (b, st) in enumerate(zip(self.blocks, states)):
            x, st = b.stream_step(x, st, mask, last_only and i == top)
            new.append(st)
        ln = self.ln_f
        if isinstance(ln, nn.LayerNorm):  # (functional: one module call fewer per step)
            return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps), new
        return ln(x), new

    @staticmethod
    def reset_rows(states: list, rows: torch.Tensor) -> list:
        """Restart the rows where ``rows`` ([B] bool) is True in every layer's state (in place)."""
        for st in states:
            Attention.reset_rows(st, rows)
        return states

    @staticmethod
    def select_rows(states: list, keep: torch.Tensor) -> list:
        """Every layer's state for the rows where ``keep`` ([B] bool) is True, in order."""
        return [Attention.select_rows(st, keep) for st in states]
