"""Kerformer (Gan, Fu, Wang, Li, Frontiers in Neurorobotics 2023, "A novel approach to attention
mechanism using kernel functions: Kerformer").

Linear attention with separate non-negative maps for queries and keys and a squeeze-and-excitation
(SE) re-weighting of the keys, computed right-to-left in O(N d^2):

    Q' = sigmoid(Q),   K' = softmax(K),   K'' = K' * SE(K'),   Y = Q' (K''^T V)  [/ Q' K''^T 1]
    SE(K') = sigmoid(W2 W1 squeeze(K'))    (the paper's gate has no ReLU between W1 and W2)

The paper leaves three things open; each reading is an option (defaults first):
- ``softmax_axis``: "feature" (each key's d_head entries sum to 1; token-local, so it has a causal
  form) or "token" (each feature sums to 1 over the real tokens, as in Shen et al.'s efficient
  attention; bidirectional only).
- ``se``: "channel" (squeeze = mean of K' over the real tokens -> one gate per channel of the D
  channels, shared by the sequence's tokens; causal: each key is gated with the mean over its own
  real prefix, so nothing from the future enters and the gate is a running statistic), "token"
  (excitation applied to each key's own channels, no squeeze over tokens) or "none".
  Hidden width D // ``se_reduction``.
- ``normalizer``: "sum" (divide by Q' K''^T 1 + eps, the linear-attention normaliser: outputs
  stay on the scale of V at every length) or "none" (the formula as printed).
The causal variant is ordinary causal linear attention on (Q', K''), with a recurrent form whose
state is S/z plus the running SE squeeze.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import StateSpec, check_int
from .linear_core import FeatureMapAttention
from .prefix import prefix_means, prefix_sums
from .registry import register

_CHOICES = {"softmax_axis": ("feature", "token"), "se": ("channel", "token", "none"), "normalizer": ("sum", "none")}


@register("kerformer")
class KerformerAttention(FeatureMapAttention):
    def __init__(self, d_model: int, n_heads: int, causal: bool = False, softmax_axis: str = "feature",
                 se: str = "channel", se_reduction: int = 4, normalizer: str = "sum", chunk: int = 64,
                 bias: bool = True):
        super().__init__(d_model, n_heads, causal, bias=bias, chunk=chunk)
        for name, value in (("softmax_axis", softmax_axis), ("se", se), ("normalizer", normalizer)):
            if value not in _CHOICES[name]:
                raise ValueError(f"{name} must be one of {_CHOICES[name]}, got {value!r}")
        if causal and softmax_axis == "token":
            raise ValueError("softmax_axis='token' normalises each key over the whole sequence and would see the "
                             "future; use softmax_axis='feature' for causal Kerformer")
        self.softmax_axis, self.se, self.normalizer = softmax_axis, se, normalizer
        self.eps = 1e-6 if normalizer == "sum" else None
        self.se_reduction = check_int("se_reduction", se_reduction, low=1)
        hidden = max(1, d_model // se_reduction)
        self.se_gate = None if se == "none" else nn.Sequential(nn.Linear(d_model, hidden), nn.Linear(hidden, d_model))

    def feature_specs(self, dtype):
        """the channel SE's running squeeze: the sum of the real keys' K' so far, and their count"""
        if self.se != "channel":
            return []
        return [StateSpec("se_sum", (self.n_heads, self.d_head), dtype), StateSpec("se_count", (), dtype)]

    def _gate(self, z):
        """z [..., H, d] -> sigmoid(W2 W1 z) [..., H, d] (the excitation on all D channels)."""
        return torch.sigmoid(self.se_gate(z.flatten(-2))).view(z.shape)

    def features(self, q, k, mask, fstate):
        fq = torch.sigmoid(q)
        if self.softmax_axis == "feature":
            fk = torch.softmax(k, dim=-1)
        else:
            logits = k if mask is None else k.masked_fill(~mask[:, None, :, None], float("-inf"))
            fk = torch.softmax(logits, dim=-2)
            if mask is not None:
                fk = fk.nan_to_num(0.0)
        if self.se == "token":
            fk = fk * self._gate(fk.transpose(1, 2)).transpose(1, 2)
        elif self.se == "channel":
            kt = fk.transpose(1, 2)  # [B, T, H, d]
            if fstate is None:
                z = prefix_means(kt, mask)
                z = z if self.causal else z[:, -1:]  # the mean over all real tokens, [B, 1, H, d]
            else:
                real = kt.new_ones(kt.shape[:2]) if mask is None else mask.to(kt.dtype)
                sums, counts = prefix_sums(kt, mask, total=fstate[0]), prefix_sums(real, total=fstate[1])
                z, fstate = sums / counts.clamp(min=1)[..., None, None], (sums[:, -1], counts[:, -1])
            fk = fk * self._gate(z).transpose(1, 2)
        return fq, fk, fstate
