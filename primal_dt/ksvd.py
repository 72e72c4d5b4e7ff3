"""The KSVD regulariser of Primal-Attention (REFERENCE.md section 1).

Per primal layer and per sequence, over its real tokens only (padding excluded):
    E  = 1/(2 H L) sum_{h, t real, k} Lambda_{h,k}^2 e_{h,t,k}^2      (R likewise with r)
    Tr = (1/H) sum_h trace(We_h^T Wr_h)
    J  = E + R - Tr
and the total regulariser is eta * mean_batch( mean_layers J_l^2 ).

Relation to the paper's KSVD objective (1/2 sum_i e_i^T Lp e_i + 1/2 sum_j r_j^T Lp r_j - Tr):
our Lambda parameterises its diagonal Lp as Lp = Lambda^2 / L (the square keeps it non-negative,
the 1/L comes from averaging over tokens, as in the reference code). The stationary point of
Lemma 4.2, Lp = S^-1 for the singular values S of the induced kernel, is therefore
Lambda = sqrt(L) * S^(-1/2), where J = 0 (tests/attention/test_ksvd.py builds it).
"""

from __future__ import annotations

import torch


def ksvd_objective(aux: dict) -> torch.Tensor:
    """J per sequence, [B], from one primal layer's ``aux``."""
    e, r, lam = aux["e"], aux["r"], aux["Lambda"]
    B, H, T, _ = e.shape
    l2 = (lam**2)[None, :, None, :]
    if aux.get("mask") is None:
        m = torch.ones(B, 1, T, dtype=e.dtype, device=e.device)
    else:
        m = aux["mask"][:, None, :].to(e.dtype)
    n = m.sum(-1).squeeze(1).clamp(min=1)  # real tokens per sequence
    E = ((l2 * e**2).sum(-1) * m).sum((1, 2)) / (2 * H * n)
    R = ((l2 * r**2).sum(-1) * m).sum((1, 2)) / (2 * H * n)
    We, Wr = aux["We"], aux["Wr"]
    Tr = (We * Wr).sum((-1, -2, -3)) / H  # scalar, or [B] for data-dependent weights
    return E + R - Tr


def ksvd_layers(auxes) -> list[torch.Tensor]:
    """J [B] of every primal layer in a stack's list of aux dicts."""
    return [ksvd_objective(a) for a in auxes if a and "Lambda" in a]


def ksvd_regularizer(auxes, eta: float) -> torch.Tensor | float:
    """eta * mean_batch(mean_layers J_l^2); 0.0 when the stack has no primal layer."""
    Js = ksvd_layers(auxes)
    if not Js or eta == 0:
        return 0.0
    return eta * torch.stack([J**2 for J in Js]).mean(0).mean()
