"""cosFormer (Qin et al., ICLR 2022, "cosFormer: Rethinking Softmax in Attention").

    s(q_i, k_j) = relu(q_i)^T relu(k_j) cos(pi/2 * (i - j) / M)

and cos(a - b) = cos a cos b + sin a sin b decomposes it: with a_i = pi i / (2M), phi(x_i) = [relu(x_i) cos a_i,
relu(x_i) sin a_i] for queries and keys, then the normalised linear attention of linear_core.

Positions i count real tokens only (1-based), so padding on either side shifts nothing. M: bidirectional, the
sequence's real tokens (|i - j| < M, all weights positive); causal, the fixed ``max_len`` (the reference uses the
padded input length, which leaks the future length into the past and cannot be streamed). Causal positions
beyond ``max_len`` would get negative weights: the parallel form raises a ValueError; the recurrent form (a
traced graph cannot raise) returns NaN outputs for those rows until they restart.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import StateSpec, check_int
from .linear_core import FeatureMapAttention
from .registry import register


@register("cosformer")
class CosformerAttention(FeatureMapAttention):
    def __init__(self, d_model: int, n_heads: int, causal: bool = False, max_len: int = 4096,
                 chunk: int = 64, bias: bool = True):
        super().__init__(d_model, n_heads, causal, bias=bias, chunk=chunk)
        self.max_len = check_int("max_len", max_len, low=1)
        self.n_features = 2 * self.d_head

    def feature_specs(self, dtype):
        """the real tokens so far"""
        return [StateSpec("count", (), torch.int64)]

    def features(self, q, k, mask, fstate):
        B, H, T, _ = q.shape
        m = torch.ones(B, T, dtype=torch.bool, device=q.device) if mask is None else mask
        pos = torch.cumsum(m.long(), dim=1)  # 1-based index among real tokens
        beyond = None
        if fstate is not None:
            pos = pos + fstate[0][:, None]
            fstate = (pos[:, -1],)
            beyond = (fstate[0] > self.max_len)[:, None, None, None]
        if self.causal:
            if fstate is None and T and int(pos.max()) > self.max_len:
                raise ValueError(f"cosformer: position {int(pos.max())} exceeds max_len={self.max_len}; the causal "
                                 "re-weighting cos(pi/2 (i-j)/max_len) needs i - j < max_len, so build it with a "
                                 "larger max_len")
            M = torch.full((B, 1), float(self.max_len), device=q.device)
        else:
            M = m.sum(1, keepdim=True).clamp(min=1).to(q.dtype)
        angle = (math.pi / 2) * pos.to(q.dtype) / M  # [B, T]
        cos, sin = (f(angle)[:, None, :, None].to(q.dtype) for f in (torch.cos, torch.sin))

        def phi(x):
            x = F.relu(x)
            return torch.cat([x * cos, x * sin], dim=-1)

        fq = phi(q)
        if beyond is not None:
            fq = torch.where(beyond, float("nan"), fq)
        return fq, phi(k), fstate
