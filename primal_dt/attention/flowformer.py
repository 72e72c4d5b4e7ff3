"""Flowformer's Flow-Attention (Wu et al., ICML 2022, "Flowformer: Linearizing Transformers with
Conservation Flows").

Attention as a flow network: sources (keys, with values) send flow to sinks (queries); with
phi = sigmoid, per head and over real tokens (n of them),

    incoming  I_i = phi(q_i)^T sum_j phi(k_j)        outgoing  O_j = phi(k_j)^T sum_i phi(q_i)
    conserved Ihat_i = phi(q_i)^T sum_j phi(k_j) / O_j      Ohat_j = phi(k_j)^T sum_i phi(q_i) / I_i
    competition  c_j = n softmax_j(clip(Ohat_j, -1, 1))       allocation  a_i = sigmoid(Ihat_i)
    y_i = a_i * phi(q_i)^T sum_j phi(k_j) (c_j v_j)^T / I_i

i.e. the normalised linear attention of linear_core on competed values, gated by the allocation.

Causal form (the paper's autoregressive version): every sum runs over the real prefix and is
divided by its count n_i (sums become means, so flows stay O(1) as the prefix grows), and the
competition is the running softmax c_j = n_j exp(Ohat_j) / sum_{l<=j} exp(Ohat_l):
    I_i = phi(q_i)^T mean_{j<=i} phi(k_j),   O_j = phi(k_j)^T mean_{l<=j} phi(q_l),
    Ihat_i = phi(q_i)^T mean_{j<=i} phi(k_j)/O_j,   Ohat_j = phi(k_j)^T mean_{l<=j} phi(q_l)/I_l.
Each quantity at position t uses only prefix sums up to t, so the recurrent form keeps three
running sums and the real tokens' count besides the S/z of the aggregation (``FlowRecurrent``).
"""

from __future__ import annotations

import torch

from .base import Attention, Recurrent, StateSpec, check_int, zero_padding
from .linear_core import linear_attention, linear_step
from .prefix import prefix_sums, running_sums
from .registry import register

_TINY = 1e-12


@register("flowformer")
class FlowAttention(Attention):
    value_projection = "qkv"
    supports_step = True

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, chunk: int = 64, bias: bool = True,
                 eps: float = 1e-6):
        super().__init__(d_model, n_heads, causal)
        self.chunk = check_int("chunk", chunk, low=1)
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.eps = float(eps)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = torch.nn.Linear(d_model, d_model, bias=bias)

    def _qkv(self, x):
        q, k, v = map(self.split_heads, self.qkv(x).split(self.d_model, dim=-1))
        return torch.sigmoid(q), torch.sigmoid(k), v

    # -- bidirectional -------------------------------------------------------------------------
    def _bidirectional(self, fq, fk, v, mask):
        B, H, T, _ = fq.shape
        m = torch.ones(B, T, dtype=torch.bool, device=fq.device) if mask is None else mask
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

    # -- causal (parallel when st is None, else recurrent) -------------------------------------
    def _running(self, x, mask, st, key):
        """Sums over the real prefix of x [B, H, T, *F] along T. ``st`` (recurrent form): a dict of the
        state's tensors, whose entry ``key`` (the sum before the chunk) is advanced."""
        xt = x.transpose(1, 2)
        if st is None:
            s = prefix_sums(xt, mask)[0]
        else:
            s = running_sums(xt, mask, st[key])
            st[key] = s[:, -1]
        return s.transpose(1, 2)

    def _causal(self, fq, fk, v, mask, st):
        B, _, T, _ = fq.shape
        real = torch.ones(B, T, dtype=fq.dtype, device=fq.device) if mask is None else mask.to(fq.dtype)
        n = self._running(real[:, None], None, st, "count")  # [B, 1, T]
        n = n.clamp(min=1)
        mq, mk = self._running(torch.stack([fq, fk], -2), mask, st, "qk").unbind(-2)  # [B, H, T, d] each
        I = ((fq * mk).sum(-1) / n).clamp(min=_TINY)
        O = ((fk * mq).sum(-1) / n).clamp(min=_TINY)
        s2 = self._running(torch.stack([fk / O[..., None], fq / I[..., None]], -2), mask, st, "flow")
        Ihat = (fq * s2[..., 0, :]).sum(-1) / n
        Ohat = (fk * s2[..., 1, :]).sum(-1) / n
        e = torch.exp(Ohat.clamp(-1.0, 1.0))
        s3 = self._running(e[..., None], mask, st, "comp")
        c = n * e / s3[..., 0].clamp(min=_TINY)
        if st is None:
            y = linear_attention(fq, fk, v * c[..., None], mask, True, self.eps, self.chunk)
        else:
            y, st["kv"] = linear_step(fq, fk, v * c[..., None], mask, st["kv"], self.eps)
        return y * torch.sigmoid(Ihat)[..., None]

    def forward(self, x, mask=None):
        self.check_input(x, mask)
        fq, fk, v = self._qkv(x)
        y = self._causal(fq, fk, v, mask, None) if self.causal else self._bidirectional(fq, fk, v, mask)
        return zero_padding(self.proj(self.merge_heads(y)), mask), {}

    def recurrent(self, *, window=None, chunk=1, precision="fp32"):
        """``FlowRecurrent`` (``window`` and ``chunk`` do not apply)."""
        self.check_recurrent(precision)
        return FlowRecurrent(self)


class FlowRecurrent(Recurrent):
    """The causal form's running sums as the state: ``count`` [1] (real tokens), ``qk`` [H, 2, d] (of
    phi(q), phi(k)), ``flow`` [H, 2, d] (of phi(k)/O, phi(q)/I), ``comp`` [H, 1] (of the competition's
    exponentials) and ``kv`` [H, d, d + 1] (the aggregation's S/z)."""

    NAMES = ("count", "qk", "flow", "comp", "kv")

    def __init__(self, attn: FlowAttention):
        H, d, dtype = attn.n_heads, attn.d_head, attn.qkv.weight.dtype
        shapes = ((1,), (H, 2, d), (H, 2, d), (H, 1), (H, d, d + 1))
        super().__init__(StateSpec(n, s, dtype) for n, s in zip(self.NAMES, shapes))
        self.attn = attn

    def forward(self, x, state, mask=None, last_only: bool = False):
        a = self.attn
        fq, fk, v = a._qkv(x)
        st = dict(zip(self.NAMES, state))
        y = zero_padding(a.proj(a.merge_heads(a._causal(fq, fk, v, mask, st))), mask)
        return (y[:, -1:] if last_only else y), tuple(st[n] for n in self.NAMES)
