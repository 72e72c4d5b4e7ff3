"""Naive O(T^2) references written from the formulas, with the explicit (kernel) matrix: the oracle every
form of a mechanism is checked against, forward and backward (flash-linear-attention keeps its
``naive.py`` for the same reason). Slow and obvious on purpose: no prefix sums, no rings, no fusion.

``naive(a, x, mask, window)`` -> y [B, T, D] for a causal mechanism ``a`` (its parameters, its feature
maps), None for mechanisms without a reference here (their own test files hold theirs). ``window``: the
one a caller imposes on an unwindowed softmax layer (the stream's), else the layer's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from primal_dt.attention.linear_core import FeatureMapAttention
from primal_dt.attention.primal import PrimalAttention
from primal_dt.attention.softmax import SoftmaxAttention


def visible(T: int, mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, T, T]: query i sees key j when j <= i, i - j < window and j is real."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    ok = (j <= i) & ((i - j < window) if window else True)
    return ok[None] & mask[:, None, :]


def heads(a, t):
    B, T, _ = t.shape
    return t.view(B, T, a.n_heads, -1).transpose(1, 2)


def merge(t):
    B, H, T, d = t.shape
    return t.transpose(1, 2).reshape(B, T, H * d)


def softmax_weights(a: SoftmaxAttention, x, mask, window=None):
    """[B, H, T, T]: softmax(q k^T / sqrt(d)) over the visible keys (a padding query sees itself)."""
    B, T, D = x.shape
    q, k = (heads(a, t) for t in a.qkv(x).split(D, -1)[:2])
    scores = q @ k.transpose(-1, -2) / a.d_head ** 0.5  # [B, H, T, T]
    ok = visible(T, mask, a.window or window) | torch.eye(T, dtype=torch.bool)  # padding queries: themselves
    return torch.softmax(scores.masked_fill(~ok[:, None], float("-inf")), -1)


def naive_softmax(a: SoftmaxAttention, x, mask, window):
    v = heads(a, a.qkv(x).split(x.shape[-1], -1)[2])
    return a.proj(merge(softmax_weights(a, x, mask, window) @ v))


def primal_features(a: PrimalAttention, x, mask):
    """(phi(qbar), phi(kbar)) [B, H, T, d]: the means of q_j, k_j over the real j <= i in the window (all
    real j when bidirectional), phi(z) = z / ||z||; phi(qbar) phi(kbar)^T is the induced kernel."""
    B, T, D = x.shape
    q, k = (heads(a, t) for t in a.qk(x).split(D, -1))  # [B, H, T, d]
    ok = visible(T, mask, a.window).to(x.dtype) if a.causal else torch.eye(T, dtype=x.dtype).expand(B, T, T)  # [B, T(i), T(j)]
    counts = ok.sum(-1).clamp(min=1)[:, None, :, None]
    return tuple(F.normalize(torch.einsum("bij,bhjd->bhid", ok, t) / counts, dim=-1) for t in (q, k))


def naive_primal(a: PrimalAttention, x, mask, window):
    """e_i = We^T phi(mean of q_j), r_i = Wr^T phi(mean of k_j) over the real j <= i in the window, phi(z) =
    z / ||z||; o_i = Wo [e_i; r_i] per head, then the output projection."""
    fq, fk = primal_features(a, x, mask)
    e = torch.einsum("bhid,hds->bhis", fq, a.W[0])
    r = torch.einsum("bhid,hds->bhis", fk, a.W[1])
    return a.proj(merge(a.Wo(torch.cat([e, r], -1))))


def naive_kernel(a: FeatureMapAttention, x, mask, window):
    """y_i = sum_j K_ij v_j / (sum_j K_ij + eps) over the visible j, K_ij = phi(q_i)^T phi(k_j) explicit."""
    B, T, D = x.shape
    q, k, v = (heads(a, t) for t in a.qkv(x).split(D, -1))
    fq, fk, _ = a.features(q, k, mask, None)
    K = (fq @ fk.transpose(-1, -2)) * visible(T, mask, None)[:, None].to(x.dtype)  # [B, H, T, T]
    y = K @ v
    if a.eps is not None:
        y = y / (K.sum(-1, keepdim=True) + a.eps)
    return a.proj(merge(y))


def naive(a, x, mask=None, window=None):
    mask = torch.ones(x.shape[:2], dtype=torch.bool) if mask is None else mask
    for kind, ref in ((SoftmaxAttention, naive_softmax), (PrimalAttention, naive_primal),
                      (FeatureMapAttention, naive_kernel)):
        if isinstance(a, kind) and getattr(type(a), "attend", None) is getattr(kind, "attend", None):
            return ref(a, x, mask, window) * mask.unsqueeze(-1).to(x.dtype)
    return None
