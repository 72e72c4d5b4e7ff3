"""Masked running (prefix) sums, the statistic behind every causal linear-time mechanism.

Causal Primal-Attention needs running means of q and k over the real tokens; the linear-attention
family needs running sums of phi(k) v^T and phi(k); causal SVR needs running key means. They all
reduce to: for each position t, the sum of x_j over real positions j <= t (or over the last
``window`` positions), and how many real positions that was. This module computes it once for
the parallel form and once for the recurrent form, built so that the two agree: the windowed
recurrent step literally re-runs the parallel computation over (ring buffer ++ chunk).

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
    """Recurrent counterpart of :func:`prefix_sums` for a fixed feature shape.

    Its state is a ``State`` whose entries are all per row:
      unwindowed: ``sum`` [B, *F] and ``count`` [B];
      windowed:   ``buf`` [B, window-1, *F] and ``buf_mask`` [B, window-1] (the last positions).
    """

    def __init__(self, window: int | None = None):
        self.window = window

    def init(self, batch: int, feat_shape, device=None, dtype=torch.float32) -> State:
        if self.window is None:
            return State(rows={
                "sum": torch.zeros(batch, *feat_shape, device=device, dtype=dtype),
                "count": torch.zeros(batch, device=device, dtype=dtype),
            })
        w = self.window - 1
        return State(rows={
            "buf": torch.zeros(batch, w, *feat_shape, device=device, dtype=dtype),
            "buf_mask": torch.zeros(batch, w, device=device, dtype=torch.bool),
        })

    def step(self, x: torch.Tensor, mask: torch.Tensor | None, st: State):
        """Consume chunk x [B, C, *F]; returns (sums [B, C, *F], counts [B, C], new state)."""
        B, C = x.shape[:2]
        m = torch.ones(B, C, dtype=torch.bool, device=x.device) if mask is None else mask
        if self.window is None:
            if C == 1:  # the streaming hot path: one token, no scan
                c = (_masked(x, m) + st["sum"].unsqueeze(1))
                n = m.to(x.dtype) + st["count"].unsqueeze(1)
            else:
                c = torch.cumsum(_masked(x, m), dim=1) + st["sum"].unsqueeze(1)
                n = torch.cumsum(m.to(x.dtype), dim=1) + st["count"].unsqueeze(1)
            return c, n, State(rows={"sum": c[:, -1], "count": n[:, -1]})
        w = self.window - 1
        xx = torch.cat([st["buf"].to(x.dtype), x], dim=1)
        mm = torch.cat([st["buf_mask"], m], dim=1)
        s, n = prefix_sums(xx, mm, self.window)
        new = State(rows={"buf": _masked(xx, mm)[:, xx.shape[1] - w :], "buf_mask": mm[:, mm.shape[1] - w :]})
        return s[:, w:], n[:, w:], new
