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
- Causal, recurrent (:class:`LinearState`): S/z as running sums in a :class:`PrefixState`, so a
  stream costs O(m d_v) per token whatever its length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Attention, check_int, zero_padding
from .prefix import PrefixState
from .state import State


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


class LinearState:
    """Recurrent S/z for causal linear attention: running sums of fk v^T (with z as a last column)."""

    def __init__(self):
        self.prefix = PrefixState()

    def init(self, batch: int, n_heads: int, m: int, dv: int, device=None, dtype=torch.float32) -> State:
        return self.prefix.init(batch, (n_heads, m, dv + 1), device=device, dtype=dtype)

    def step(self, fq, fk, v, mask, st: State, eps: float | None = 1e-6):
        """fq [B, H, C, m], fk [B, H, C, m], v [B, H, C, dv] -> (y [B, H, C, dv], state)."""
        outer = fk.transpose(1, 2).unsqueeze(-1) * _with_ones(v).transpose(1, 2).unsqueeze(-2)  # [B,C,H,m,dv+1]
        sums, _, st = self.prefix.step(outer, mask, st)
        out = torch.einsum("bhcm,bchmv->bhcv", fq, sums)
        return _normalise(out, eps), st


class FeatureMapAttention(Attention):
    """Base of the linear family: q, k, v projections, feature maps, the shared kernel, output proj.

    Subclasses define ``features(q, k, mask, fstate) -> (fq, fk, fstate)`` on [B, H, T, d_head]
    heads. ``fstate`` is None in the parallel form; in the recurrent form it is the mechanism's own
    part of the state (positions, prefix statistics; a ``State`` nested under ``feat``, next to the
    S/z under ``kv``), created by ``init_feature_state``, so that features of a chunk are computed
    exactly as the parallel form computes them at those positions.
    """

    supports_step = True
    #: added to the normaliser; None = no normaliser
    eps: float | None = 1e-6

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, bias: bool = True, chunk: int = 64):
        super().__init__(d_model, n_heads, causal)
        self.chunk = check_int("chunk", chunk, low=1)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self._kv = LinearState()

    #: feature dimension m of fq, fk
    @property
    def n_features(self) -> int:
        return self.d_head

    def features(self, q, k, mask, fstate):
        raise NotImplementedError

    def init_feature_state(self, batch: int, device=None, dtype=None) -> State:
        return State()

    def _qkv(self, x):
        return map(self.split_heads, self.qkv(x).split(self.d_model, dim=-1))

    def forward(self, x, mask=None):
        self.check_input(x, mask)
        q, k, v = self._qkv(x)
        fq, fk, _ = self.features(q, k, mask, None)
        y = linear_attention(fq, fk, v, mask, self.causal, self.eps, self.chunk)
        return zero_padding(self.proj(self.merge_heads(y)), mask), {}

    def init_state(self, batch, device=None, dtype=None):
        self._require_step()
        dtype = dtype or self.qkv.weight.dtype
        return State(rows={"kv": self._kv.init(batch, self.n_heads, self.n_features, self.d_head, device, dtype),
                           "feat": self.init_feature_state(batch, device, dtype)})

    def step(self, x, state, mask=None):
        self._require_step()
        self.check_input(x, mask)
        q, k, v = self._qkv(x)
        fq, fk, feat = self.features(q, k, mask, state["feat"])
        y, kv = self._kv.step(fq, fk, v, mask, state["kv"], self.eps)
        return zero_padding(self.proj(self.merge_heads(y)), mask), State(rows={"kv": kv, "feat": feat})

    @torch.no_grad()
    def attention_matrix(self, x, mask=None) -> torch.Tensor:
        """[B, H, T, T]: the (normalised) weights fq_i fk_j / sum_j' fq_i fk_j' the kernel implies."""
        self.check_input(x, mask)
        q, k, _ = self._qkv(x)
        fq, fk, _ = self.features(q, k, mask, None)
        return kernel_weights(fq @ fk.transpose(-1, -2), mask, self.causal, self.eps)


def kernel_weights(kmat: torch.Tensor, mask, causal: bool, eps: float | None) -> torch.Tensor:
    """Mask a [B, H, T, T] kernel matrix (padding keys, the future) and normalise its rows."""
    T = kmat.shape[-1]
    allowed = torch.ones(T, T, dtype=torch.bool, device=kmat.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :] & mask[:, None, :, None]
    kmat = kmat * allowed.to(kmat.dtype)
    return kmat if eps is None else kmat / (kmat.sum(-1, keepdim=True) + eps)
