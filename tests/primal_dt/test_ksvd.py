"""KSVD regulariser: zero at the KSVD stationary point (Lemma 4.2), padding excluded, per sequence."""

import pytest
import torch

from primal_dt.attention import build_attention
from primal_dt.attention.primal import cosine_features, evenly_spaced_rows
from primal_dt.ksvd import ksvd_layers, ksvd_objective, ksvd_regularizer

D, H, S, T = 16, 2, 4, 10
dh = D // H


def stationary_point(a, x):
    """Set We, Wr, Lambda from the dual (SVD) solution of the induced kernel of each head."""
    with torch.no_grad():
        qk = a.qk(x)[0]
        for h in range(H):
            pq = cosine_features(qk[:, h * dh:(h + 1) * dh].double())
            pk = cosine_features(qk[:, D + h * dh: D + (h + 1) * dh].double())
            K = pq @ pk.T  # [T, T] asymmetric kernel matrix
            U, Sv, Vh = torch.linalg.svd(K)
            U, Sv, V = U[:, :S], Sv[:S], Vh[:S].T
            a.W[0][h] = (pk.T @ V).float()  # sum_j phi_k(x_j) h_r_j^T, H_r = V
            a.W[1][h] = (pq.T @ U).float()  # sum_i phi_q(x_i) h_e_i^T, H_e = U
            # paper's Lambda_p = S^-1; ours enters as Lambda^2 / T (see primal_dt/ksvd.py)
            a.Lambda[h] = (T / Sv).sqrt().float()


def data_dependent_stationary_point(a, x):
    """The same construction for the data-dependent form: token i's primal features are
    psi(q_i) = f_h phi(q_i) (f_h: the n sampled rows of x, channel block h), and the KSVD variables
    are the parameters We, Wr in R^{n x s} acting on them (paper eq. 11). Rows of We, Wr beyond n
    are left random: neither the scores nor the trace read them."""
    with torch.no_grad():
        qk = a.qk(x)[0]
        f = evenly_spaced_rows(x, None, a.s * a.rank_multi)[0].double()  # [n, D]
        n = f.shape[0]
        for h in range(H):
            fh = f[:, h * dh:(h + 1) * dh]
            psi_q = cosine_features(qk[:, h * dh:(h + 1) * dh].double()) @ fh.T  # [T, n]
            psi_k = cosine_features(qk[:, D + h * dh: D + (h + 1) * dh].double()) @ fh.T
            U, Sv, Vh = torch.linalg.svd(psi_q @ psi_k.T)
            U, Sv, V = U[:, :S], Sv[:S], Vh[:S].T
            a.W[0][h, :n] = (psi_k.T @ V).float()
            a.W[1][h, :n] = (psi_q.T @ U).float()
            a.Lambda[h] = (T / Sv).sqrt().float()


@pytest.mark.parametrize("rank_multi", [2, 5], ids=["n=s*rank_multi", "n=T<s*rank_multi"])
def test_J_vanishes_at_the_data_dependent_stationary_point(rank_multi):
    torch.manual_seed(3)
    a = build_attention("primal", D, H, s=S, data_dependent=True, rank_multi=rank_multi).eval()
    x = torch.randn(1, T, D)
    J_random = ksvd_objective(a(x)[1])
    data_dependent_stationary_point(a, x)
    J = ksvd_objective(a(x)[1])
    assert J.abs().item() < 1e-4, J
    assert J_random.abs().item() > 1e-2
    # the per-sample trace Tr(W_{e|X}^T W_{r|X}) would be far from the stationary value here
    with torch.no_grad():
        We_X, _ = a._weights(x, None)
        per_sample = (We_X[0, 0] * We_X[0, 1]).sum() / H
    assert (per_sample - (a(x)[1]["We"] * a(x)[1]["Wr"]).sum() / H).abs().item() > 1e-2
    with torch.no_grad():
        a.W[1].add_(0.05 * torch.randn_like(a.W[1]))
    assert ksvd_objective(a(x)[1]).abs().item() > 10 * J.abs().item()


def test_J_vanishes_at_the_ksvd_stationary_point():
    torch.manual_seed(0)
    a = build_attention("primal", D, H, s=S).eval()
    x = torch.randn(1, T, D)
    J_random = ksvd_objective(a(x)[1])
    stationary_point(a, x)
    J = ksvd_objective(a(x)[1])
    assert J.abs().item() < 1e-4
    assert J_random.abs().item() > 1e-2  # random weights are far from it
    # and it is a genuine optimum of the regulariser: perturbing the weights raises J^2
    with torch.no_grad():
        a.W[0].add_(0.05 * torch.randn_like(a.W[0]))
    assert ksvd_objective(a(x)[1]).abs().item() > 10 * J.abs().item()


def naive_J(aux, b, real, n_max=None):
    e, r, lam = aux["e"][b][:, real], aux["r"][b][:, real], aux["Lambda"]
    L = len(real)
    E = sum((lam[h, k] ** 2) * (e[h, t, k] ** 2) for h in range(H) for t in range(L) for k in range(S)) / (2 * H * L)
    R = sum((lam[h, k] ** 2) * (r[h, t, k] ** 2) for h in range(H) for t in range(L) for k in range(S)) / (2 * H * L)
    We, Wr = aux["We"], aux["Wr"]  # the parameters, in every form
    if n_max is not None:  # data-dependent: the leading rows this sequence sampled, min(s * rank_multi, L)
        We, Wr = We[:, :min(n_max, L)], Wr[:, :min(n_max, L)]
    Tr = sum(torch.trace(We[h].T @ Wr[h]) for h in range(H)) / H
    return E + R - Tr


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False, data_dependent=True, rank_multi=2)],
                         ids=["causal", "data-dependent"])
def test_J_matches_naive_formula_over_real_tokens_only(kw):
    torch.manual_seed(1)
    a = build_attention("primal", D, H, s=S, **kw).eval()
    x = torch.randn(2, 7, D)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    aux = a(x, mask)[1]
    J = ksvd_objective(aux)
    for b in range(2):
        real = mask[b].nonzero().flatten().tolist()
        n_max = S * kw["rank_multi"] if kw.get("data_dependent") else None
        torch.testing.assert_close(J[b], naive_J(aux, b, real, n_max), atol=1e-5, rtol=1e-5)
    # padding never enters: the same sequences without padding give the same J
    J0 = ksvd_objective(a(x[:1, :5])[1])
    torch.testing.assert_close(J[0], J0[0], atol=1e-5, rtol=1e-5)


def test_regularizer_is_eta_times_batch_mean_of_layer_mean_of_J_squared():
    torch.manual_seed(2)
    a1 = build_attention("primal", D, H, s=S, causal=True)
    a2 = build_attention("primal", D, H, s=S, causal=True)
    x = torch.randn(3, 6, D)
    auxes = [a1(x)[1], {}, a2(x)[1]]  # a softmax layer contributes an empty aux
    J1, J2 = ksvd_layers(auxes)
    expected = 0.05 * ((J1**2 + J2**2) / 2).mean()
    torch.testing.assert_close(ksvd_regularizer(auxes, 0.05), expected)
    assert ksvd_regularizer([{}, {}], 0.05) == 0.0
    # it is differentiable with respect to Lambda and the projection weights
    ksvd_regularizer(auxes, 0.05).backward()
    assert a1.Lambda.grad is not None and a1.W.grad.abs().sum() > 0
