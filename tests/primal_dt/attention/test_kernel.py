"""Kernel-smoother attention (Transformer Dissection) against the explicit kernel formulas."""

import math

import pytest
import torch

from .probe import attention_matrix
from primal_dt.attention import available, build_attention
from primal_dt.attention.kernel import sinusoidal

D, H = 12, 3
dh = D // H
MASK = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)

KERNELS = {
    "linear": lambda q, k: q @ k,
    "polynomial": lambda q, k: (q @ k) ** 2,
    "exponential": lambda q, k: torch.exp(q @ k / math.sqrt(dh)),
    "rbf": lambda q, k: torch.exp(-((q - k) ** 2).sum() / math.sqrt(dh)),
}


def naive_smoother(a, x, mask, kernel):
    B, T, _ = x.shape
    qk = a.qk(x)
    q, k = (qk, qk) if a.symmetric or a.positional else qk.split(D, -1)
    v = a.v(x)
    out = torch.zeros(B, T, D)
    for b in range(B):
        real = [t for t in range(T) if mask is None or mask[b, t]]
        if a.positional:  # product of symmetric kernels on features f and positions t (real index)
            tpos = a.pos_proj(sinusoidal(torch.arange(len(real), dtype=x.dtype), D))
            where = {t: n for n, t in enumerate(real)}
        for i in real:
            heads = []
            for h in range(H):
                sl = slice(h * dh, (h + 1) * dh)
                ws = []
                for j in real:
                    if a.causal and j > i:
                        continue
                    if a.positional:
                        kij = (torch.exp(q[b, i, sl] @ k[b, j, sl] / math.sqrt(dh))
                               * torch.exp(tpos[where[i], sl] @ tpos[where[j], sl] / math.sqrt(dh)))
                    else:
                        kij = kernel(q[b, i, sl], k[b, j, sl])
                    ws.append((kij, v[b, j, sl]))
                den = sum(abs(w) for w, _ in ws)  # abs: no-op if k >= 0
                eps = 0 if a.kernel in ("exponential", "rbf") else 1e-6
                heads.append(sum(w * vj for w, vj in ws) / (den + eps))
            out[b, i] = a.proj(torch.cat(heads))
    return out


@pytest.mark.parametrize("name", [n for n in available() if n.startswith("kernel-")])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_explicit_kernel(name, causal):
    torch.manual_seed(0)
    a = build_attention(name, D, H, causal=causal).double().eval()
    x = torch.randn(2, 7, D, dtype=torch.float64)
    with torch.no_grad():
        y, _ = a(x, MASK)
        ref = naive_smoother(a, x, MASK, KERNELS[a.kernel] if not a.positional else None)
    torch.testing.assert_close(y, ref.to(y.dtype), atol=1e-8, rtol=1e-7)


def test_exponential_kernel_is_softmax_attention_and_stable():
    a = build_attention("kernel-exponential-asym", D, H).eval()
    x = 200 * torch.randn(1, 6, D)  # exp(<q,k>) would overflow without log-sum-exp
    y, _ = a(x)
    assert torch.isfinite(y).all()
    A = attention_matrix(a, x, None)  # (probe.py)
    torch.testing.assert_close(A.sum(-1), torch.ones(1, H, 6))


def test_symmetric_variants_tie_the_projections():
    sym, asym = build_attention("kernel-rbf-sym", D, H), build_attention("kernel-rbf-asym", D, H)
    assert sym.qk.out_features == D and asym.qk.out_features == 2 * D
    A = attention_matrix(sym, torch.randn(1, 5, D), None)
    # a symmetric kernel matrix: k(x_i, x_j) = k(x_j, x_i), so the unnormalised weights are symmetric
    q = sym.split_heads(sym.qk(torch.randn(1, 5, D)))
    kmat = torch.exp(-torch.cdist(q, q) ** 2 / math.sqrt(dh))
    torch.testing.assert_close(kmat, kmat.transpose(-1, -2))
    assert A.shape == (1, H, 5, 5)


def test_positional_form_shifts_with_real_positions_only():
    a = build_attention("kernel-positional", D, H).eval()
    x = torch.randn(1, 5, D)
    y, _ = a(x)
    y2, _ = a(torch.cat([torch.randn(1, 2, D), x], 1), torch.tensor([[False, False] + [True] * 5]))
    torch.testing.assert_close(y2[:, 2:], y, atol=1e-5, rtol=1e-5)
    z, _ = a(x.flip(1))  # positions matter: reversing the order changes the outputs
    assert not torch.allclose(z.flip(1), y, atol=1e-4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="eps"):
        build_attention("kernel-rbf-asym", D, H, eps=-1.0)
