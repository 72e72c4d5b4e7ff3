"""Flowformer's Flow-Attention (Wu et al., ICML 2022, "Flowformer: Linearizing Transformers with
Conservation Flows").

Attention as a flow network: sources (keys, with values) send flow to sinks (queries); with
phi = sigmoid, per head and over real tokens (n of them),

    incoming  I_i = phi(q_i)^T sum_j phi(k_j)        outgoing  O_j = phi(k_j)^T sum_i phi(q_i)
    conserved Ihat_i = phi(q_i)^T sum_j phi(k_j) / O_j      Ohat_j = phi(k_j)^T sum_i phi(q_i) / I_i
    competition  c_j = n softmax_j(clip(Ohat_j, -1, 1))       allocation  a_i = sigmoid(Ihat_i)
    y_i = a_i * phi(q_i)^T sum_j phi(k_j) (c_j v_j)^T / I_i

i.e. the normalised linear attention of linear_core on competed values, gated by the allocation.

Causal form (the paper's autoregressive version): every sum runs over the real prefix and is divided by its
count n_i (sums become means, so flows stay O(1) as the prefix grows), e.g. I_i = phi(q_i)^T mean_{j<=i}
phi(k_j), and the competition is the running softmax c_j = n_j exp(Ohat_j) / sum_{l<=j} exp(Ohat_l). Every
quantity at t uses prefix sums up to t only, so the recurrent form keeps running sums.
"""

from __future__ import annotations

import torch

from .base import StateSpec
from .linear_core import FeatureMapAttention, linear_attention
from .prefix import prefix_sums
from .registry import register

_TINY = 1e-12


@register("flowformer")
class FlowAttention(FeatureMapAttention):
    def __init__(self, d_model: int, n_heads: int, causal: bool = False, chunk: int = 64, bias: bool = True,
                 eps: float = 1e-6):
        super().__init__(d_model, n_heads, causal, bias=bias, chunk=chunk)
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.eps = float(eps)

    def specs(self, dtype):
        """The causal form's running sums: ``count`` (real tokens), ``qk`` (of phi(q), phi(k)), ``flow`` (of
        phi(k)/O, phi(q)/I), ``comp`` (of the competition's exponentials), ``kv`` (the aggregation's S/z)."""
        H, d = self.n_heads, self.d_head
        shapes = {"count": (1,), "qk": (H, 2, d), "flow": (H, 2, d), "comp": (H, 1), "kv": (H, d, d + 1)}
        return [StateSpec(n, s, dtype) for n, s in shapes.items()]

    def attend(self, q, k, v, mask, state):
        fq, fk = torch.sigmoid(q), torch.sigmoid(k)
        if not self.causal:
            return self._bidirectional(fq, fk, v, mask), None
        it = iter(() if state is None else state)
        new = []

        def running(x, mask):  # sums over the real prefix of x [B, H, T, *F] along T, after the state's
            s = prefix_sums(x.transpose(1, 2), mask, total=next(it, None))
            new.append(s[:, -1])
            return s.transpose(1, 2)

        B, _, T, _ = fq.shape
        real = torch.ones(B, T, dtype=fq.dtype, device=fq.device) if mask is None else mask.to(fq.dtype)
        n = running(real[:, None], None).clamp(min=1)  # [B, 1, T]
        mq, mk = running(torch.stack([fq, fk], -2), mask).unbind(-2)  # [B, H, T, d] each
        I = ((fq * mk).sum(-1) / n).clamp(min=_TINY)
        O = ((fk * mq).sum(-1) / n).clamp(min=_TINY)
        s2 = running(torch.stack([fk / O[..., None], fq / I[..., None]], -2), mask)
        Ihat = (fq * s2[..., 0, :]).sum(-1) / n
        Ohat = (fk * s2[..., 1, :]).sum(-1) / n
        e = torch.exp(Ohat.clamp(-1.0, 1.0))
        c = n * e / running(e[..., None], mask)[..., 0].clamp(min=_TINY)
        out = linear_attention(fq, fk, v * c[..., None], mask, True, self.eps, self.chunk, next(it, None))
        y, kv = out if state is not None else (out, None)
        return y * torch.sigmoid(Ihat)[..., None], (None if state is None else (*new, kv))

    def _bidirectional(self, fq, fk, v, mask):
        m = torch.ones(fq.shape[0], fq.shape[2], dtype=torch.bool, device=fq.device) if mask is None else mask
        w = m[:, None, :, None].to(fq.dtype)
        n = m.sum(1).to(fq.dtype)[:, None, None]  # [B, 1, 1]
        fq, fk = fq * w, fk * w
        I = (fq @ fk.sum(2, keepdim=True).transpose(-1, -2)).squeeze(-1).clamp(min=_TINY)  # [B, H, T]
        O = (fk @ fq.sum(2, keepdim=True).transpose(-1, -2)).squeeze(-1).clamp(min=_TINY)
        Ihat = (fq @ (fk / O[..., None]).sum(2, keepdim=True).transpose(-1, -2)).squeeze(-1)
        Ohat = (fk @ (fq / I[..., None]).sum(2, keepdim=True).transpose(-1, -2)).squeeze(-1)
        logits = Ohat.clamp(-1.0, 1.0).masked_fill(~m[:, None, :], float("-inf"))
        c = n * torch.softmax(logits, dim=-1)
        y = linear_attention(fq, fk, v * c[..., None], m, False, self.eps)
        return y * torch.sigmoid(Ihat)[..., None]
