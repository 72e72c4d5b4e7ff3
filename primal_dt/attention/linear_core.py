"""The one normalised linear-attention kernel shared by the linear family.

Given non-negative feature maps fq = phi(q), fk = phi(k) (per head), every member of the family
(linear, performer, cosformer, flowformer's aggregation, kerformer, the linear SVR versions)
computes

    y_i = fq_i^T S_i / (fq_i^T z_i + eps),   S_i = sum_{j in M(i)} fk_j v_j^T,   z_i = sum_{j in M(i)} fk_j

with M(i) = all real keys (bidirectional) or the real keys j <= i (causal). The normaliser rides
along as an extra value column of ones, so S and z are one tensor [m, d_v + 1].

- Bidirectional: two matmuls, O(T m d_v).
- Causal, parallel: chunked (flash-linear-attention's "chunk" form): inside a chunk of ``chunk``
  tokens an explicit masked L x L product, across chunks an exclusive prefix sum of per-chunk
  states. Memory O(T L + (T/L) m d_v) instead of the O(T m d_v) of a cumulative sum of outer
  products, which matters at the benchmark's lengths.
- Causal, recurrent (:class:`LinearRecurrent`, :func:`linear_step`): S/z as running sums, so a
  stream costs O(m d_v) per token whatever its length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Attention, Recurrent, StateSpec, check_int, zero_padding
from .prefix import running_sums


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def _normalise(out: torch.Tensor, eps: float | None) -> torch.Tensor:
    """eps=None: no normaliser (the raw sum fq^T S, for readings that leave it out)."""
    return out[..., :-1] if eps is None else out[..., :-1] / (out[..., -1:] + eps)


def linear_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                     causal: bool = False, eps: float | None = 1e-6, chunk: int = 64) -> torch.Tensor:
    """fq [B, H, Tq, m], fk [B, H, Tk, m], v [B, H, Tk, dv], key_mask [B, Tk] -> [B, H, Tq, dv].

    ``eps=None`` drops the normaliser (returns fq^T S).
    Causal requires Tq == Tk (query i sees keys j <= i). Padding keys are zeroed here; padding
    queries produce finite garbage that the caller zeroes.
    """
    if key_mask is not None:
        fk = fk * key_mask[:, None, :, None].to(fk.dtype)
    v1 = _with_ones(v)
    if not causal:
        return _normalise(fq @ (fk.transpose(-1, -2) @ v1), eps)
    B, H, T, m = fq.shape
    L = max(1, min(chunk, T))
    pad = (-T) % L
    if pad:
        fq, fk, v1 = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v1))
    n = (T + pad) // L
    fq_c, fk_c, v_c = (t.reshape(B, H, n, L, t.shape[-1]) for t in (fq, fk, v1))
    tril = torch.ones(L, L, dtype=torch.bool, device=fq.device).tril()
    intra = ((fq_c @ fk_c.transpose(-1, -2)) * tril) @ v_c  # [B, H, n, L, dv+1]
    kv = fk_c.transpose(-1, -2) @ v_c  # per-chunk states [B, H, n, m, dv+1]
    before = torch.cumsum(kv, dim=2) - kv  # state entering each chunk (exclusive prefix)
    out = intra + fq_c @ before
    return _normalise(out.reshape(B, H, n * L, -1)[:, :, :T], eps)


def linear_step(fq, fk, v, mask, kv, eps: float | None = 1e-6):
    """The recurrent kernel: fq [B, H, C, m], fk [B, H, C, m], v [B, H, C, dv] and the running S/z
    ``kv`` [B, H, m, dv + 1] (z the last column) -> (y [B, H, C, dv], the next ``kv``)."""
    outer = fk.transpose(1, 2).unsqueeze(-1) * _with_ones(v).transpose(1, 2).unsqueeze(-2)  # [B,C,H,m,dv+1]
    sums = running_sums(outer, mask, kv)
    out = torch.einsum("bhcm,bchmv->bhcv", fq, sums)
    return _normalise(out, eps), sums[:, -1]


class FeatureMapAttention(Attention):
    """Base of the linear family: q, k, v projections, feature maps, the shared kernel, output proj.

    Subclasses define ``features(q, k, mask, fstate) -> (fq, fk, fstate)`` on [B, H, T, d_head]
    heads. ``fstate`` is None in the parallel form; in the recurrent form it is the mechanism's own
    part of the state, a tuple of tensors laid out as ``feature_specs`` (positions, prefix statistics),
    after the S/z ``kv``, so that features of a chunk are computed exactly as the parallel form
    computes them at those positions.
    """

    value_projection = "qkv"
    supports_step = True
    #: added to the normaliser; None = no normaliser
    eps: float | None = 1e-6

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, bias: bool = True, chunk: int = 64):
        super().__init__(d_model, n_heads, causal)
        self.chunk = check_int("chunk", chunk, low=1)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    #: feature dimension m of fq, fk
    @property
    def n_features(self) -> int:
        return self.d_head

    def features(self, q, k, mask, fstate):
        raise NotImplementedError

    def feature_specs(self, dtype: torch.dtype) -> list[StateSpec]:
        """The recurrent state ``features`` keeps (none by default)."""
        return []

    def _qkv(self, x):
        return map(self.split_heads, self.qkv(x).split(self.d_model, dim=-1))

    def forward(self, x, mask=None):
        self.check_input(x, mask)
        q, k, v = self._qkv(x)
        fq, fk, _ = self.features(q, k, mask, None)
        y = linear_attention(fq, fk, v, mask, self.causal, self.eps, self.chunk)
        return zero_padding(self.proj(self.merge_heads(y)), mask), {}

    def recurrent(self, *, window=None, chunk=1, precision="fp32"):
        """``LinearRecurrent`` (``window`` and ``chunk`` do not apply: the state is S/z and the features')."""
        self.check_recurrent(precision)
        return LinearRecurrent(self)


class LinearRecurrent(Recurrent):
    """The linear family's recurrent form: state ``kv`` [H, m, d_head + 1] (S and z), then the feature
    map's own (``FeatureMapAttention.feature_specs``)."""

    def __init__(self, attn: FeatureMapAttention):
        dtype = attn.qkv.weight.dtype
        super().__init__([StateSpec("kv", (attn.n_heads, attn.n_features, attn.d_head + 1), dtype),
                          *attn.feature_specs(dtype)])
        self.attn = attn

    def forward(self, x, state, mask=None, last_only: bool = False):
        a = self.attn
        q, k, v = a._qkv(x)
        fq, fk, feat = a.features(q, k, mask, tuple(state[1:]))
        y, kv = linear_step(fq, fk, v, mask, state[0], a.eps)
        y = zero_padding(a.proj(a.merge_heads(y)), mask)
        return (y[:, -1:] if last_only else y), (kv, *feat)
