"""Linformer (Wang, Li, Khabsa, Fang, Ma, 2020, "Linformer: Self-Attention with Linear Complexity");
bidirectional only.

Keys and values are projected along the sequence axis to k rows before softmax attention:

    y = softmax(Q (E K)^T / sqrt(d)) (F V),   E, F in R^{k x n} learned, n = ``max_len``

O(T k) time and memory. E and F are shared by the heads (the paper's head-wise sharing; with
``share_kv=True`` also F = E, key-value sharing). Column t of E multiplies the t-th *real* token
(padding is dropped before the projection, so padding on either side changes nothing); a sequence
with more than ``max_len`` real tokens is an error. E, F ~ N(0, 1/k), the paper's JL projection.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import ProjectedAttention, check_int
from .registry import register


@register("linformer")
class LinformerAttention(ProjectedAttention):
    supports_causal = False

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, proj_dim: int = 64, max_len: int = 4096,
                 share_kv: bool = False, bias: bool = True):
        super().__init__(d_model, n_heads, causal, bias)
        self.proj_dim = check_int("proj_dim", proj_dim, low=1)
        self.max_len = check_int("max_len", max_len, low=1)
        self.E = nn.Parameter(torch.randn(proj_dim, max_len) / math.sqrt(proj_dim))
        self.F = None if share_kv else nn.Parameter(torch.randn(proj_dim, max_len) / math.sqrt(proj_dim))

    def attend(self, q, k, v, mask, state):
        B, _, T, _ = q.shape
        m = torch.ones(B, T, dtype=torch.bool, device=q.device) if mask is None else mask
        n = int(m.sum(1).max()) if B else 0
        if n > self.max_len:
            raise ValueError(f"linformer: a sequence has {n} real tokens but max_len={self.max_len}; the projections "
                             f"E, F have one column per position, so build it with max_len >= {n}")
        pos = (torch.cumsum(m.long(), 1) - 1).clamp(min=0)  # index among real tokens
        w = m[..., None].to(q.dtype)

        def project(P, t):  # sum over real tokens j of P[:, pos_j] t_j -> [B, H, k, d]
            return torch.einsum("btk,bhtd->bhkd", P.T[pos] * w, t)

        kp = project(self.E, k)
        vp = project(self.E if self.F is None else self.F, v)
        att = torch.softmax(q @ kp.transpose(-1, -2) / math.sqrt(self.d_head), -1)
        return att @ vp, None
