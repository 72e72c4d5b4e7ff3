"""Transformer blocks and stacks whose layers each name their attention mechanism.

A stack is a list of ``LayerSpec``s, so "PrimalFormer" (every layer primal) and "Primal.+X"
(backbone X, last layer primal) are configurations (see layouts.py), not code. The stack runs
in parallel (``forward``) or recurrently (``init_state`` / ``step``), the latter threading each
layer's attention state; blocks are otherwise token-wise, so the two agree whenever every
mechanism's ``step`` agrees with its ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from .attention import build_attention
from .attention.base import Attention


@dataclass
class LayerSpec:
    attention: str = "softmax"
    options: dict = field(default_factory=dict)


_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


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

    def init_state(self, batch: int, device=None, dtype=None) -> list:
        if not self.supports_step:
            bad = [s.attention for s, b in zip(self.specs, self.blocks) if not b.attn.supports_step]
            raise ValueError(f"recurrent stepping needs a causal stack of mechanisms with a recurrent form; "
                             f"causal={self.causal}, without one: {bad}")
        return [b.attn.init_state(batch, device=device, dtype=dtype) for b in self.blocks]

    def step(self, x, states: list, mask=None):
        """Consume chunk x [B, C, D]; returns (y [B, C, D], new states)."""
        new = []
        for b, st in zip(self.blocks, states):
            x, st = b.step(x, st, mask)
            new.append(st)
        return self.ln_f(x), new

    @staticmethod
    def reset_rows(states: list, rows: torch.Tensor) -> list:
        for st in states:
            Attention.reset_rows(st, rows)
        return states
