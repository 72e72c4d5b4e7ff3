"""Masked running (prefix) sums, the statistic behind every causal linear-time mechanism.

Causal Primal-Attention needs running means of q and k over the real tokens; the linear-attention
family needs running sums of phi(k) v^T and phi(k); causal SVR needs running key means. They all
reduce to: for each position t, the sum of x_j over real positions j <= t (or over the last
``window`` positions), and how many real positions that was. This module computes it for the
parallel form (windows included) and, unwindowed, for the recurrent form of the linear family.

Windowed sums subtract two cumulative sums, so they accumulate in float64 to stay exact to float32
precision on long sequences; unwindowed sums accumulate in the input's dtype (a sequential scan in
both forms) to keep memory and per-step overhead low.
"""

from __future__ import annotations

import torch

from .state import State


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x
    return x * mask.view(*mask.shape, *([1] * (x.dim() - 2))).to(x.dtype)


def prefix_sums(
    x: torch.Tensor, mask: torch.Tensor | None = None, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Running sums over real tokens along dim 1.

    x: [B, T, *F]; mask: [B, T] bool or None. Returns (sums [B, T, *F] in x.dtype,
    counts [B, T] float) where position t covers positions j <= t, or t - window < j <= t.
    """
    B, T = x.shape[:2]
    m = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask
    if window is None or window >= T:
        return torch.cumsum(_masked(x, m), dim=1), torch.cumsum(m.to(x.dtype), dim=1)
    c = torch.cumsum(_masked(x, m).double(), dim=1)
    n = torch.cumsum(m.double(), dim=1)
    c = torch.cat([c[:, :window], c[:, window:] - c[:, :-window]], dim=1)
    n = torch.cat([n[:, :window], n[:, window:] - n[:, :-window]], dim=1)
    return c.to(x.dtype), n.to(x.dtype)


def prefix_means(x, mask=None, window=None) -> torch.Tensor:
    """Running means over real tokens; 0 where no real token has been seen yet."""
    s, n = prefix_sums(x, mask, window)
    return s / n.clamp(min=1).view(*n.shape, *([1] * (x.dim() - 2)))


class PrefixState:
    """Recurrent counterpart of unwindowed :func:`prefix_sums` for a fixed feature shape: a ``State`` of
    ``sum`` [B, *F] and ``count`` [B], both per row."""

    def init(self, batch: int, feat_shape, device=None, dtype=torch.float32) -> State:
        return State(rows={
            "sum": torch.zeros(batch, *feat_shape, device=device, dtype=dtype),
            "count": torch.zeros(batch, device=device, dtype=dtype),
        })

    def step(self, x: torch.Tensor, mask: torch.Tensor | None, st: State):
        """Consume chunk x [B, C, *F]; returns (sums [B, C, *F], counts [B, C], new state)."""
        B, C = x.shape[:2]
        m = torch.ones(B, C, dtype=torch.bool, device=x.device) if mask is None else mask
        if C == 1:  # the streaming hot path: one token, no scan
            c = (_masked(x, m) + st["sum"].unsqueeze(1))
            n = m.to(x.dtype) + st["count"].unsqueeze(1)
        else:
            c = torch.cumsum(_masked(x, m), dim=1) + st["sum"].unsqueeze(1)
            n = torch.cumsum(m.to(x.dtype), dim=1) + st["count"].unsqueeze(1)
        return c, n, State(rows={"sum": c[:, -1], "count": n[:, -1]})
