"""Kerformer (Gan, Fu, Wang, Li, Frontiers in Neurorobotics 2023, "A novel approach to attention
mechanism using kernel functions: Kerformer").

Linear attention with separate non-negative maps for queries and keys and a squeeze-and-excitation
(SE) re-weighting of the keys, computed right-to-left in O(N d^2):

    Q' = sigmoid(Q),   K' = softmax(K),   K'' = K' * SE(K'),   Y = Q' (K''^T V) / (Q' K''^T 1 + eps)
    SE(K') = sigmoid(W2 W1 squeeze(K'))    (the paper's gate has no ReLU between W1 and W2)

The paper leaves open over which axis K is normalised and what the SE squeeze averages. Here each key's
softmax runs over its d_head features (token-local, so it has a causal form); the squeeze is the mean of K'
over the real tokens, one gate per channel of D (causal: over the key's own real prefix, a running statistic),
hidden width D // ``se_reduction``; the linear-attention normaliser keeps outputs on the scale of V at every
length. The recurrent state is S/z plus the running SE squeeze.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import StateSpec, check_int
from .linear_core import FeatureMapAttention
from .prefix import prefix_means, prefix_sums
from .registry import register


@register("kerformer")
class KerformerAttention(FeatureMapAttention):
    def __init__(self, d_model: int, n_heads: int, causal: bool = False, se_reduction: int = 4, chunk: int = 64,
                 bias: bool = True):
        super().__init__(d_model, n_heads, causal, bias=bias, chunk=chunk)
        self.se_reduction = check_int("se_reduction", se_reduction, low=1)
        hidden = max(1, d_model // se_reduction)
        self.se_gate = nn.Sequential(nn.Linear(d_model, hidden), nn.Linear(hidden, d_model))

    def feature_specs(self, dtype):
        """the SE's running squeeze: the sum of the real keys' K' so far, and their count"""
        return [StateSpec("se_sum", (self.n_heads, self.d_head), dtype), StateSpec("se_count", (), dtype)]

    def features(self, q, k, mask, fstate):
        fk = torch.softmax(k, dim=-1)
        kt = fk.transpose(1, 2)  # [B, T, H, d]
        if fstate is None:
            z = prefix_means(kt, mask)
            z = z if self.causal else z[:, -1:]  # the mean over all real tokens, [B, 1, H, d]
        else:
            real = kt.new_ones(kt.shape[:2]) if mask is None else mask.to(kt.dtype)
            sums, counts = prefix_sums(kt, mask, total=fstate[0]), prefix_sums(real, total=fstate[1])
            z, fstate = sums / counts.clamp(min=1)[..., None, None], (sums[:, -1], counts[:, -1])
        gate = torch.sigmoid(self.se_gate(z.flatten(-2))).view(z.shape)  # the excitation on all D channels
        return torch.sigmoid(q), fk * gate.transpose(1, 2), fstate
