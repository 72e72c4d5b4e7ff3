"""The KSVD regulariser of Primal-Attention (Chen et al. 2023, Primal-Attention, Sec. 4).

Per primal layer and per sequence, over its real tokens only (padding excluded):
    E  = 1/(2 H L) sum_{h, t real, k} Lambda_{h,k}^2 e_{h,t,k}^2      (R likewise with r)
    Tr = (1/H) sum_h trace(We_h^T Wr_h)
    J  = E + R - Tr
and the total regulariser is eta * mean_batch( mean_layers J_l^2 ).

The parameterisation of Lambda this package promises: the paper's diagonal Lp (the KSVD's inverse singular
values) is Lp = Lambda^2 / L, Lambda the layer's learnable [H, s] parameter. The square keeps Lp non-negative
whatever the optimizer does (a negative Lp makes E + R unbounded below), and the 1/L, the average over a
sequence's L real tokens, makes J comparable across lengths and padding (as the reference code). Lemma 4.2's
stationary point Lp = S^-1 is therefore Lambda = sqrt(L) * S^(-1/2), where J = 0.

The trace term uses the parameters We, Wr in every form (paper eqs. 6 and 11, Lemma 4.2), never a per-sample
W_{e|X}: in the data-dependent form token i's primal features are f(X) phi(q_i) and We, Wr act on them. A
sequence that samples n_b < s * rank_multi rows has its trace over the rows it used: padding never changes J.
"""

from __future__ import annotations

import torch


def ksvd_objective(aux: dict) -> torch.Tensor:
    """J per sequence, [B], from one primal layer's ``aux``."""
    e, r, lam = aux["e"], aux["r"], aux["Lambda"]
    B, H, T, _ = e.shape
    l2 = (lam**2)[None, :, None, :]
    mask = aux.get("mask")
    m = torch.ones(B, 1, T, dtype=e.dtype, device=e.device) if mask is None else mask[:, None].to(e.dtype)
    n = m.sum(-1).squeeze(1).clamp(min=1)  # real tokens per sequence
    E, R = (((l2 * x**2).sum(-1) * m).sum((1, 2)) / (2 * H * n) for x in (e, r))
    # the parameters; in the data-dependent form each sequence's trace covers the rows it used
    per_row = (aux["We"] * aux["Wr"]).sum((0, 2)) / H  # [rows]
    if aux.get("rows") is None:
        Tr = per_row.sum()
    else:
        used = torch.arange(per_row.shape[0], device=per_row.device) < aux["rows"][:, None]
        Tr = (used.to(per_row.dtype) * per_row).sum(-1)
    return E + R - Tr


def ksvd_layers(auxes) -> list[torch.Tensor]:
    return [ksvd_objective(a) for a in auxes if a and "Lambda" in a]


def ksvd_regularizer(auxes, eta: float) -> torch.Tensor | float:
    """eta * mean_batch(mean_layers J_l^2); 0.0 when the stack has no primal layer."""
    Js = ksvd_layers(auxes)
    return eta * torch.stack([J**2 for J in Js]).mean(0).mean() if Js and eta != 0 else 0.0
