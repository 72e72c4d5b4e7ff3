"""Nystromformer (Xiong et al., AAAI 2021, "Nystromformer: A Nystrom-Based Algorithm for
Approximating Self-Attention"); bidirectional only.

With m landmarks q~, k~ (segment means of the queries and keys) the softmax attention
softmax(Q K^T / sqrt(d)) V is approximated by

    softmax(Q k~^T / sqrt(d)) pinv(softmax(q~ k~^T / sqrt(d))) softmax(q~ K^T / sqrt(d)) V

with pinv computed by the paper's Newton-Schulz iteration
    Z_0 = A^T / (||A||_1 ||A||_inf),   Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4.
Cost O(T m) time and memory.

Segments cover the real tokens only: a sequence with n_b of them uses m_b = min(landmarks, n_b) segments, real
token j going to segment floor(j m_b / n_b) (the paper's equal segments when m_b divides n_b). Unused landmark
slots are masked out of the first softmax and get identity rows/columns in A, which leaves the used block's
pseudo-inverse as it is. Z_0 is scaled per matrix (the reference takes the batch's maximum, letting one sequence
change another's output). The reference's optional depth-wise convolution skip on V is not included.
"""

from __future__ import annotations

import torch

from .base import ProjectedAttention, check_int
from .registry import register


def newton_schulz_pinv(A: torch.Tensor, iters: int) -> torch.Tensor:
    """Iterative Moore-Penrose pseudo-inverse of the non-negative matrices A [..., m, m]."""
    scale = A.sum(-2).amax(-1) * A.sum(-1).amax(-1)  # ||A||_1 ||A||_inf per matrix
    Z = A.transpose(-1, -2) / scale[..., None, None]
    eye = torch.eye(A.shape[-1], device=A.device, dtype=A.dtype)
    for _ in range(iters):
        AZ = A @ Z
        Z = 0.25 * Z @ (13 * eye - AZ @ (15 * eye - AZ @ (7 * eye - AZ)))
    return Z


def segment_means(x: torch.Tensor, mask: torch.Tensor, m: int):
    """x [B, H, T, d] -> (means of up to m segments of the real tokens [B, H, m, d], used [B, m])."""
    B, H, T, d = x.shape
    n = mask.sum(1, keepdim=True)  # [B, 1]
    mb = n.clamp(max=m)
    j = torch.cumsum(mask.long(), 1) - 1
    seg = torch.where(mask, torch.div(j * mb, n.clamp(min=1), rounding_mode="floor"), torch.full_like(j, m))
    onehot = torch.nn.functional.one_hot(seg, m + 1)[..., :m].to(x.dtype)  # [B, T, m]; padding -> none
    counts = onehot.sum(1)  # [B, m]
    means = torch.einsum("btm,bhtd->bhmd", onehot, x) / counts.clamp(min=1)[:, None, :, None]
    return means, counts > 0


@register("nystrom")
class NystromAttention(ProjectedAttention):
    supports_causal = False

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, landmarks: int = 32, pinv_iters: int = 6,
                 bias: bool = True):
        super().__init__(d_model, n_heads, causal, bias)
        self.landmarks = check_int("landmarks", landmarks, low=1)
        self.pinv_iters = check_int("pinv_iters", pinv_iters, low=0)

    def attend(self, q, k, v, mask, state):
        m = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device) if mask is None else mask
        scale = self.d_head ** -0.25  # 1/sqrt(d) split between q and k, as in the paper's code
        q, k = q * scale, k * scale
        ql, used = segment_means(q, m, self.landmarks)
        kl, _ = segment_means(k, m, self.landmarks)
        neg = float("-inf")
        F1 = torch.softmax((q @ kl.transpose(-1, -2)).masked_fill(~used[:, None, None, :], neg), -1)
        A = torch.softmax((ql @ kl.transpose(-1, -2)).masked_fill(~used[:, None, None, :], neg), -1)
        both = used[:, :, None] & used[:, None, :]
        eye = torch.eye(self.landmarks, device=q.device, dtype=q.dtype)
        A = torch.where(both[:, None], A.nan_to_num(0.0), eye)
        B3 = torch.softmax((ql @ k.transpose(-1, -2)).masked_fill(~m[:, None, None, :], neg), -1)
        return F1 @ (newton_schulz_pinv(A, self.pinv_iters) @ (B3 @ v)), None
