"""Primal-Attention (Chen, Tao, Tonin, Suykens, NeurIPS 2023): self-attention as the primal form of
an asymmetric kernel SVD on the induced kernel k(x_i, x_j) = <phi(q_i), phi(k_j)>.

Per head, with the cosine feature map phi(z) = z / ||z||: e_i = We^T phi(q_i), r_i = Wr^T phi(k_i),
o_i = Wo [e_i ; r_i] (We, Wr: d_head x s directions; Wo: 2s -> d_head shared by heads; no value projection),
then the heads are concatenated and projected D -> D. ``aux`` carries e, r, the weights and Lambda for the
KSVD regulariser (primal_dt/ksvd.py).

Forms:
- bidirectional, data-independent: We, Wr are parameters, so each token's output depends on that token
  alone: no N x N kernel is ever formed.
- bidirectional, data-dependent (``data_dependent=True``): W_{e|X} = f(X)^T We with f(X) the n = min(s *
  rank_multi, L) evenly spaced *real* rows of the layer input (head h reads channel block h).
- causal: q_i, k_i are replaced by their running means over the real prefix (or the last ``window``
  positions) before phi (the reference divides by the position and so counts padding; we do not).

Recurrent form (``PrimalRecurrent``; causal, data-independent): running sums of q|k, O(H * d_head) per
sequence, read out by the parallel form's scores (phi normalises, so the sum gives the mean's features: no
count). With a window: a ring of the last ``window`` positions' q|k and their sum in float64 (added to and
subtracted from, so it must not drift).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .base import Attention, Recurrent, StateSpec, check_int, check_window, static, zero_padding
from .prefix import prefix_means, prefix_sums
from .registry import register


def cosine_features(z: torch.Tensor) -> torch.Tensor:
    return F.normalize(z, dim=-1, eps=1e-12)


def evenly_spaced_rows(x: torch.Tensor, mask: torch.Tensor | None, n_max: int):
    """f(X): n = min(n_max, T) evenly spaced real rows of x [B, T, D] per sequence, [B, n, D] (zero rows where a
    sequence has fewer than n real tokens, so they add nothing to f(X)^T We)."""
    B, T, _ = x.shape
    n = min(n_max, T)
    m = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask
    lengths = m.sum(1)
    order = torch.sort((~m).to(torch.int8), dim=1, stable=True).indices  # real tokens first, in sequence order
    n_b = lengths.clamp(max=n)  # rows used per sequence
    j = torch.arange(n, device=x.device).expand(B, n)
    k = torch.div(j * (lengths - 1).clamp(min=0)[:, None], (n_b - 1).clamp(min=1)[:, None], rounding_mode="floor")
    valid = j < n_b.unsqueeze(1)
    idx = torch.gather(order, 1, torch.where(valid, k, 0))
    rows = torch.gather(x, 1, idx.unsqueeze(-1).expand(B, n, x.shape[-1]))
    return rows * valid.unsqueeze(-1).to(x.dtype)


@register("primal")
class PrimalAttention(Attention):
    supports_step = True
    supports_window = True

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, s: int = 32,
                 data_dependent: bool = False, rank_multi: int = 10, window: int | None = None,
                 dropout: float = 0.0, bias: bool = True):
        super().__init__(d_model, n_heads, causal)
        self.s = check_int("s", s, low=1)
        if s > d_model:
            raise ValueError(f"s={s} projection directions exceed d_model={d_model}: the induced kernel of a head has "
                             f"rank <= d_head={self.d_head}, so s beyond d_model is a configuration error; use "
                             f"s <= {d_model} (the papers use 20-96)")
        if s > self.d_head and not data_dependent:
            warnings.warn(f"s={s} > d_head={self.d_head}: directions beyond the kernel's rank are redundant",
                          stacklevel=2)
        self.rank_multi = check_int("rank_multi", rank_multi, low=1)
        self.window = check_window(window)
        if data_dependent and causal:
            raise ValueError("data_dependent=True samples rows from the whole sequence and would see the "
                             "future; use data_dependent=False for causal Primal-Attention")
        if self.window is not None and not causal:
            raise ValueError("window applies to causal Primal-Attention (windowed running means); "
                             "set causal=True or window=None")
        self.data_dependent = bool(data_dependent)
        rows = s * rank_multi if data_dependent else self.d_head
        self.qk = nn.Linear(d_model, 2 * d_model, bias=bias)
        self.W = nn.Parameter(torch.empty(2, n_heads, rows, s))  # [We, Wr]: both score sets from one einsum
        self.Lambda = nn.Parameter(torch.rand(n_heads, s))
        self.Wo = nn.Linear(2 * s, self.d_head, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.f_dropout = nn.Dropout(dropout)
        with torch.no_grad():
            for w in self.W:
                nn.init.orthogonal_(w)

    def _weights(self, x, mask):
        """(W, rows): W = [We; Wr], [2, H, d_head, s], or data-dependent W_{e|X} = f(X)^T We, [B, 2, H, d_head, s];
        ``rows``: None (all rows entered), or [B] each sequence's n_b = min(s * rank_multi, real length)."""
        if not self.data_dependent:
            return self.W, None
        f = self.f_dropout(evenly_spaced_rows(x, mask, self.s * self.rank_multi))  # [B, n, D]
        n = f.shape[1]
        f = f.view(f.shape[0], n, self.n_heads, self.d_head)
        lengths = torch.full((x.shape[0],), x.shape[1], device=x.device) if mask is None else mask.sum(1)
        return torch.einsum("bnhd,chns->bchds", f, self.W[:, :, :n]), lengths.clamp(max=n)

    def _scores_and_output(self, qk, W, mask):
        """qk: [B, T, 2, H, d] (running means when causal) -> (y [B, T, D], scores [B, H, T, 2s] = [e, r])."""
        eq = "btchd,chds->bhtcs" if W.dim() == 4 else "btchd,bchds->bhtcs"
        sc = torch.einsum(eq, cosine_features(qk), W).flatten(-2)  # [B, H, T, 2s]
        y = zero_padding(self.proj(self.merge_heads(self.Wo(sc))), mask)
        return y, sc

    def forward(self, x, mask=None):
        self.check_input(x, mask)
        qk = self.qk(x).view(*x.shape[:2], 2, self.n_heads, self.d_head)
        if self.causal:
            qk = prefix_means(qk, mask, self.window)
        W, rows = self._weights(x, mask)
        y, sc = self._scores_and_output(qk, W, mask)
        n = self.W.shape[2] if rows is None else int(rows.max()) if rows.numel() else 0
        # what the KSVD regulariser reads; rows: [B] how many leading rows of We, Wr each sequence used (None: all)
        return y, {"e": sc[..., : self.s], "r": sc[..., self.s :], "We": self.W[0, :, :n], "Wr": self.W[1, :, :n],
                   "Lambda": self.Lambda, "mask": mask, "rows": rows}

    def recurrent(self, *, window=None, chunk=1):
        if self.data_dependent:
            raise ValueError("data-dependent Primal-Attention has no causal form to stream; use "
                             "data_dependent=False for a streamed (causal) layer")
        self.check_recurrent()
        return PrimalRecurrent(self)


class PrimalRecurrent(Recurrent):
    """State ``sum`` [2D], the running sum of q|k over the row's real tokens; with the layer's ``window``,
    ``ring`` [window, 2D] (oldest first) and ``S`` [2D] float64, their sum (module docstring)."""

    def __init__(self, attn: PrimalAttention):
        dtype, D = attn.qk.weight.dtype, attn.d_model
        if attn.window is None:
            specs = [StateSpec("sum", (2 * D,), dtype)]
        else:
            specs = [StateSpec("ring", (attn.window, 2 * D), dtype), StateSpec("S", (2 * D,), torch.float64)]
        super().__init__(specs)
        self.attn = attn

    def forward(self, x, state, mask=None, last_only: bool = False):
        y, state, _ = self.forward_aux(x, state, mask, last_only)
        return y, state

    def forward_aux(self, x, state, mask=None, last_only: bool = False):
        """``forward`` and the chunk's scores for the KSVD regulariser, as ``PrimalAttention.forward``'s aux."""
        a = self.attn
        C = static(x.shape[1])
        if a.window is not None and C > a.window:  # the ring holds `window` new positions at a time
            return self._in_pieces(x, state, mask, last_only)
        qk = a.qk(x)
        if a.window is None:
            sums = prefix_sums(qk, mask, total=state[0])
            new = (sums[:, -1],)
        else:
            ring, S = state
            sums64 = prefix_sums((zero_padding(qk, mask) - ring[:, :C]).double(), total=S)  # ring[:, :C]: leaving
            sums, new = sums64.to(qk.dtype), (torch.cat([ring[:, C:], zero_padding(qk, mask)], 1), sums64[:, -1])
        if last_only:
            sums, mask = sums[:, -1:], None if mask is None else mask[:, -1:]
        y, sc = a._scores_and_output(sums.view(-1, static(sums.shape[1]), 2, a.n_heads, a.d_head), a.W, mask)
        return y, new, {"e": sc[..., : a.s], "r": sc[..., a.s :], "We": a.W[0], "Wr": a.W[1], "Lambda": a.Lambda,
                        "mask": mask, "rows": None}

    def _in_pieces(self, x, state, mask, last_only):
        """``forward_aux`` over pieces of at most ``window`` tokens, their scores joined along the chunk."""
        w, outs = self.attn.window, []
        for i in range(0, x.shape[1], w):
            outs.append(self.forward_aux(x[:, i:i + w], state, None if mask is None else mask[:, i:i + w], last_only))
            state = outs[-1][1]
        aux = dict(outs[-1][2])
        if not last_only:
            for k in ("e", "r"):
                aux[k] = torch.cat([o[2][k] for o in outs], 2)
            aux["mask"] = mask
        return (outs[-1][0] if last_only else torch.cat([o[0] for o in outs], 1)), state, aux
