"""Linear Transformer (Katharopoulos, Vyas, Pappas, Fleuret, ICML 2020, "Transformers are RNNs").

    phi(x) = elu(x) + 1,   y_i = phi(q_i)^T sum_j phi(k_j) v_j^T / (phi(q_i)^T sum_j phi(k_j) + eps)

with j over all real tokens (bidirectional) or real tokens j <= i (causal). The causal form is an
RNN whose state is S = sum phi(k) v^T and z = sum phi(k) (linear_core).
"""

from __future__ import annotations

import torch.nn.functional as F

from .linear_core import FeatureMapAttention
from .registry import register


def elu_feature(x):
    """elu(x) + 1 > 0: the Linear Transformer's feature map (reused by the linear SVR versions)."""
    return F.elu(x) + 1


@register("linear")
class LinearAttention(FeatureMapAttention):
    def features(self, q, k, mask, fstate):
        return elu_feature(q), elu_feature(k), fstate
