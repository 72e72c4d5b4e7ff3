"""Attention-BN, Attention-SH and Attention-BN+SH (Nguyen, Nguyen, Ho, Bertozzi, Osher, Nguyen,
ICLR 2023, "A Primal-Dual Framework for Transformers and Neural Networks"): attentions derived as
the dual of a support-vector regression with different primal feature maps.

Per head (width d), mu = mean of the keys over the sequence:
    svr-bn:    score(i, j) = (q_i - beta mu)^T (k_j - beta mu) / sqrt(d)
               (the paper's experiments: re-centring only, the keys' variance is not divided out)
    svr-sh:    head h attends to the keys/values average-pooled by factor r_h along the sequence (queries
               keep full length); default r = 2^(h // max(1, H // 4)): the paper's [1,1,2,2,4,4,8,8] for 8 heads
    svr-bn-sh: both; mu per head over that head's pooled keys
    ``kernel="softmax"``: y_i = sum_j softmax_j(score(i, j)) v_j
    ``kernel="linear"``:  the elu+1 linear attention on the re-centred queries and keys
Pooling runs over the real tokens, compacted first (padding on either side changes nothing); a bidirectional
sequence's last group may be partial (the mean of its members). In the softmax form only the queries are
shifted: (q - beta mu)^T (k_j - beta mu) differs from (q - beta mu)^T k_j by a term constant in j.

Causal forms (not in the paper; our choices, no future leakage):
- Statistics: query i uses mu_i of the real keys j <= i (token level, also with SH). The softmax form thus
  applies the bidirectional formula to the prefix; the linear form cannot re-centre old keys without losing
  its running sums, so each (pooled) key is re-centred with its own prefix's statistics.
- Pooling: query i of group g sees the completed groups g' < g and the running mean of its own group's
  members up to itself, never a member after it.
Recurrent form: the real tokens' projections are cached and each chunk recomputed from the cache, so step ==
forward exactly (O(prefix) per step, like a key/value cache).
"""

from __future__ import annotations

import math

import torch

from .base import ProjectedAttention, StateSpec, check_int
from .linear import elu_feature
from .linear_core import linear_attention
from .registry import register


def compact(xs, mask):
    """Move each sequence's real tokens to the front (in order): xs [B, H, T, d] -> same, plus n [B]."""
    idx = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, None, :, None]  # real tokens first
    return [x.gather(2, idx.expand(-1, x.shape[1], -1, x.shape[3])) for x in xs], mask.sum(1)


def default_factors(n_heads: int) -> tuple[int, ...]:
    return tuple(2 ** (h // max(1, n_heads // 4)) for h in range(n_heads))


def _pad_to(x, r):
    pad = (-x.shape[2]) % r
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


@register("svr-bn-sh")
class SVRAttention(ProjectedAttention):
    """``svr-bn-sh``, and the implementation of the other two variants (``use_bn``/``use_sh`` pick one)."""

    supports_step = True
    use_bn: bool = True
    use_sh: bool = True

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, kernel: str = "softmax",
                 beta: float = 0.5, factors=None, bias: bool = True):
        super().__init__(d_model, n_heads, causal, bias)
        if kernel not in ("softmax", "linear"):
            raise ValueError(f"kernel must be 'softmax' or 'linear', got {kernel!r}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta):
            raise ValueError(f"beta must be a finite number, got {beta!r}")
        if factors is None:
            factors = default_factors(n_heads) if self.use_sh else (1,) * n_heads
        factors = tuple(factors) if isinstance(factors, (list, tuple)) else factors
        if not isinstance(factors, tuple) or len(factors) != n_heads:
            raise ValueError(f"factors must list one pooling factor per head ({n_heads}), got {factors!r}")
        for f in factors:
            check_int("factors entry", f, low=1)
        self.kernel, self.beta, self.factors = kernel, float(beta), factors

    def _shift(self, x, mu):
        return x - self.beta * mu if self.use_bn else x

    def _bidirectional(self, q, kc, vc, n, r):
        B, h, _, d = q.shape
        kc, vc = _pad_to(kc, r), _pad_to(vc, r)
        G = kc.shape[2] // r
        cm = (torch.arange(G * r, device=q.device)[None] < n[:, None])  # [B, Np]
        w = cm.view(B, 1, G, r, 1).to(q.dtype)
        cnt = w.sum(3)  # [B, 1, G, 1]
        pk, pv = ((x.view(B, h, G, r, d) * w).sum(3) / cnt.clamp(min=1) for x in (kc, vc))
        pmask = cnt[:, 0, :, 0] > 0  # [B, G]
        pw = pmask[:, None, :, None].to(q.dtype)
        mu = (pk * pw).sum(2, keepdim=True) / pw.sum(2, keepdim=True).clamp(min=1)  # (read by BN only)
        if self.kernel == "softmax":
            qq = self._shift(q, mu)  # fused kernel: O(T) memory like softmax's
            return torch.nn.functional.scaled_dot_product_attention(qq, pk, pv, attn_mask=pmask[:, None, None, :])
        fq, fk = elu_feature(self._shift(q, mu)), elu_feature(self._shift(pk, mu))
        return linear_attention(fq, fk, pv, pmask)

    def _causal(self, qc, kc, vc, n, p, r):
        """Compact q/k/v [B, h, N, d] (first n real); outputs [B, h, Tq, d] for compact positions p [B, Tq]."""
        B, h, _, d = qc.shape
        qc, kc, vc = (_pad_to(t, r) for t in (qc, kc, vc))
        Np = kc.shape[2]
        G = Np // r
        cm = (torch.arange(Np, device=qc.device)[None] < n[:, None])[:, None, :, None].to(qc.dtype)
        kc, vc = kc * cm, vc * cm
        within = torch.arange(1, r + 1, device=qc.device, dtype=qc.dtype)[:, None]
        run_k = (kc.view(B, h, G, r, d).cumsum(3) / within).view(B, h, Np, d)  # own group's running mean
        run_v = (vc.view(B, h, G, r, d).cumsum(3) / within).view(B, h, Np, d)
        pk, pv = run_k[:, :, r - 1 :: r], run_v[:, :, r - 1 :: r]  # completed-group means [B, h, G, d]
        mu = kc.cumsum(2) / torch.arange(1, Np + 1, device=qc.device, dtype=qc.dtype)[:, None]  # (read by BN only)

        def at(x, pos):  # gather [B, h, Np, d] at positions pos [B, Tq]
            return x.gather(2, pos[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))

        mu_q, k_cur, v_cur = at(mu, p), at(run_k, p), at(run_v, p)
        if self.kernel == "softmax":
            qq = self._shift(at(qc, p), mu_q)
            logits = qq @ pk.transpose(-1, -2) / math.sqrt(d)  # [B, h, Tq, G]
            seen = torch.arange(G, device=qc.device)[None, None, :] < (p // r)[:, :, None]
            logits = logits.masked_fill(~seen[:, None], float("-inf"))
            cur = (qq * k_cur).sum(-1, keepdim=True) / math.sqrt(d)
            wts = torch.softmax(torch.cat([logits, cur], -1), -1)
            return wts[..., :G] @ pv + wts[..., G:] * v_cur
        # linear: completed groups enter a causal linear attention at the first position after them
        fq_all = elu_feature(self._shift(qc, mu))
        ends = (torch.arange(G, device=qc.device) * r + r - 1)[None].expand(B, G)  # each group's last member
        fk_g = elu_feature(self._shift(pk, at(mu, ends)))
        fk_seq, v_seq = torch.zeros_like(kc), torch.zeros(B, h, Np, d + 1, device=qc.device, dtype=qc.dtype)
        fk_seq[:, :, r::r] = fk_g[:, :, : G - 1]
        v_seq[:, :, r::r] = torch.cat([pv, torch.ones_like(pv[..., :1])], -1)[:, :, : G - 1]
        numden = at(linear_attention(fq_all, fk_seq, v_seq, causal=True, eps=None), p)  # [B, h, Tq, d+1]
        fq = at(fq_all, p)
        wc = (fq * elu_feature(self._shift(k_cur, mu_q))).sum(-1, keepdim=True)
        return (numden[..., :d] + wc * v_cur) / (numden[..., d:] + wc + 1e-6)

    def _heads(self, q, qc, kc, vc, n, p):
        out = torch.empty_like(q)
        for r in sorted(set(self.factors)):
            heads = [i for i, f in enumerate(self.factors) if f == r]
            sel = torch.tensor(heads, device=q.device)
            if self.causal:
                out[:, heads] = self._causal(qc[:, sel], kc[:, sel], vc[:, sel], n, p, r)
            else:
                out[:, heads] = self._bidirectional(q[:, sel], kc[:, sel], vc[:, sel], n, r)
        return out

    def specs(self, dtype):
        """the real tokens' projections, compacted, ``q``, ``k``, ``v`` [H, n, d] (n grows with the longest row)
        and ``n`` [] int64, the real tokens each row holds (module docstring)"""
        return [*(StateSpec(n, (self.n_heads, 0, self.d_head), dtype) for n in "qkv"), StateSpec("n", (), torch.int64)]

    def attend(self, q, k, v, mask, state):
        B, _, C, _ = q.shape
        m = torch.ones(B, C, dtype=torch.bool, device=q.device) if mask is None else mask
        if state is None:
            (qc, kc, vc), n = compact([q, k, v], m)
            p = (torch.cumsum(m.long(), 1) - 1).clamp(min=0)  # compact position of each token
        else:
            Q, K, V, n0 = state
            cached = torch.arange(K.shape[2], device=q.device)[None] < n0[:, None]
            full = [torch.cat([Q, q], 2), torch.cat([K, k], 2), torch.cat([V, v], 2)]
            (qc, kc, vc), n = compact(full, torch.cat([cached, m], 1))
            keep = max(int(n.max()), 1) if B else 0  # >= 1 slot so an all-padding chunk still gathers
            qc, kc, vc = qc[:, :, :keep], kc[:, :, :keep], vc[:, :, :keep]
            p = (n0[:, None] + torch.cumsum(m.long(), 1) - 1).clamp(min=0)
            state = (qc, kc, vc, n)
        return self._heads(q, qc, kc, vc, n, p), state


@register("svr-bn")
class SVRBNAttention(SVRAttention):
    use_bn, use_sh = True, False

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, kernel: str = "softmax",
                 beta: float = 0.5, bias: bool = True):
        super().__init__(d_model, n_heads, causal, kernel=kernel, beta=beta, bias=bias)


@register("svr-sh")
class SVRSHAttention(SVRAttention):
    use_bn, use_sh = False, True

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, kernel: str = "softmax", factors=None,
                 bias: bool = True):
        super().__init__(d_model, n_heads, causal, kernel=kernel, factors=factors, bias=bias)
