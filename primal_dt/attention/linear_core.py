"""The one normalised linear-attention kernel and module base of the linear family (linear, performer,
cosformer, flowformer's aggregation, kerformer, the linear SVR versions). With non-negative feature maps
fq = phi(q), fk = phi(k) per head:

    y_i = fq_i^T S_i / (fq_i^T z_i + eps),   S_i = sum_{j in M(i)} fk_j v_j^T,   z_i = sum_{j in M(i)} fk_j

with M(i) = all real keys (bidirectional) or the real keys j <= i (causal); the normaliser rides along as a
value column of ones, so S and z are one tensor [m, d_v + 1]. The causal form is flash-linear-attention's
"chunk" form (a masked L x L product inside a chunk, a prefix sum of per-chunk states across chunks, after the
``state`` of the tokens before): memory O(T L + (T/L) m d_v), and the recurrent form is it fed a chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import ProjectedAttention, StateSpec, check_int


def linear_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                     causal: bool = False, eps: float | None = 1e-6, chunk: int = 64,
                     state: torch.Tensor | None = None):
    """fq [B, H, Tq, m], fk [B, H, Tk, m], v [B, H, Tk, dv], key_mask [B, Tk] -> y [B, H, Tq, dv], or with the
    causal ``state`` S/z [B, H, m, dv + 1], (y, the state after). ``eps=None`` drops the normaliser. Causal
    needs Tq == Tk. Padding queries get finite garbage the caller zeroes."""
    if key_mask is not None:
        fk = fk * key_mask[:, None, :, None].to(fk.dtype)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)

    def normalise(out):
        return out[..., :-1] if eps is None else out[..., :-1] / (out[..., -1:] + eps)

    if not causal:
        return normalise(fq @ (fk.transpose(-1, -2) @ v1))
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
    after = torch.cumsum(kv, dim=2) + (0 if state is None else state.unsqueeze(2))
    out = normalise((intra + fq_c @ (after - kv)).reshape(B, H, n * L, -1)[:, :, :T])
    return out if state is None else (out, after[:, :, -1])


class FeatureMapAttention(ProjectedAttention):
    """Base of the linear family: ``attend`` is the feature map ``features(q, k, mask, fstate) -> (fq, fk,
    fstate)`` and the shared kernel, its state the S/z ``kv`` then the map's own (``feature_specs``), so a chunk's
    features are exactly the parallel form's at those positions."""

    supports_step = True
    #: added to the normaliser; None = no normaliser
    eps: float | None = 1e-6

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, bias: bool = True, chunk: int = 64):
        super().__init__(d_model, n_heads, causal, bias)
        self.chunk = check_int("chunk", chunk, low=1)
        self.n_features = self.d_head  #: feature dimension m of fq, fk (a feature map may widen it)

    def features(self, q, k, mask, fstate):
        raise NotImplementedError

    def feature_specs(self, dtype: torch.dtype) -> list[StateSpec]:
        return []

    def specs(self, dtype: torch.dtype) -> list[StateSpec]:
        return [StateSpec("kv", (self.n_heads, self.n_features, self.d_head + 1), dtype), *self.feature_specs(dtype)]

    def attend(self, q, k, v, mask, state):
        fq, fk, feat = self.features(q, k, mask, None if state is None else tuple(state[1:]))
        if state is None:
            return linear_attention(fq, fk, v, mask, self.causal, self.eps, self.chunk), None
        y, kv = linear_attention(fq, fk, v, mask, True, self.eps, self.chunk, state[0])
        return y, (kv, *feat)
