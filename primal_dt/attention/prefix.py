"""Masked running (prefix) sums, the statistic behind every causal linear-time mechanism.

Causal Primal-Attention needs running means of q and k over the real tokens; the linear-attention
family needs running sums of phi(k) v^T and phi(k); causal SVR needs running key means. They all
reduce to: for each position t, the sum of x_j over real positions j <= t (or over the last
``window`` positions), and how many real positions that was. This module computes it for the
parallel form (windows included) and, unwindowed, for the recurrent forms (``running_sums``).

Windowed sums subtract two cumulative sums, so they accumulate in float64 to stay exact to float32
precision on long sequences; unwindowed sums accumulate in the input's dtype (a sequential scan in
both forms) to keep memory and per-step overhead low.
"""

from __future__ import annotations

import torch


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


def running_sums(x: torch.Tensor, mask: torch.Tensor | None, total: torch.Tensor) -> torch.Tensor:
    """Recurrent counterpart of unwindowed :func:`prefix_sums`: x [B, C, *F] is the next chunk and
    ``total`` [B, *F] the sum of the real tokens before it (a recurrent state); returns the sums
    [B, C, *F] at every position of the chunk (the last one is the next state)."""
    return torch.cumsum(_masked(x, mask), dim=1) + total.unsqueeze(1)
