"""The linear family (linear, performer, cosformer, kerformer) against explicit per-token sums
written from each paper's formula, plus mechanism-specific behaviour."""

import math

import pytest
import torch
import torch.nn.functional as F

from .probe import attention_matrix
from primal_dt.attention import build_attention
from primal_dt.attention.performer import orthogonal_gaussian

D, H = 12, 3
MASK = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)


def naive_kernel_attention(a, x, mask, score, eps=1e-6):
    """Explicit per-token sums y_i = sum_j s(i, j) v_j / (sum_j s(i, j) + eps) over the visible real j.

    score(qh, kh, b, i, j, h) is the (non-negative) kernel between head h's projections of tokens
    i and j of sequence b. ``eps=None``: no normaliser.
    """
    B, T, _ = x.shape
    d_model, n_heads = a.d_model, a.n_heads
    q, k, v = a.qkv(x).split(d_model, -1)
    dh = d_model // n_heads
    out = torch.zeros(B, T, d_model, dtype=x.dtype)
    for b in range(B):
        real = [t for t in range(T) if mask is None or mask[b, t]]
        for i in real:
            heads = []
            for h in range(n_heads):
                sl = slice(h * dh, (h + 1) * dh)
                num, den = 0, 0
                for j in real:
                    if a.causal and j > i:
                        continue
                    s = score(q[b, i, sl], k[b, j, sl], b, i, j, h)
                    num, den = num + s * v[b, j, sl], den + s
                heads.append(num if eps is None else num / (den + eps))
            out[b, i] = a.proj(torch.cat(heads))
    return out


def elu1(z):
    return F.elu(z) + 1


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_linear_matches_naive_reference(causal, masked):
    torch.manual_seed(0)
    a = build_attention("linear", D, H, causal=causal, chunk=3).eval()
    x = torch.randn(2, 7, D)
    mask = MASK if masked else None
    y, _ = a(x, mask)
    ref = naive_kernel_attention(a, x, mask, lambda qh, kh, *_: elu1(qh) @ elu1(kh))
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_linear_attention_matrix_rows_are_the_normalised_kernel():
    a = build_attention("linear", D, H, causal=True).eval()
    x = torch.randn(2, 7, D)
    A = attention_matrix(a, x, MASK)  # (probe.py)
    assert A.shape == (2, H, 7, 7)
    assert (A.triu(1) == 0).all()
    real_rows = A.sum(-1)[MASK[:, None, :].expand(2, H, 7)]
    torch.testing.assert_close(real_rows, torch.ones_like(real_rows), atol=1e-5, rtol=1e-5)


def test_bad_chunk_is_a_value_error():
    with pytest.raises(ValueError, match="chunk"):
        build_attention("linear", D, H, chunk=0)


# -- performer --------------------------------------------------------------------------------

def favor_phi(a, z):
    """The literal FAVOR+ feature map: exp(w_r^T x' - ||x'||^2 / 2), x' = x / d^(1/4) (no stabilisation)."""
    x = z * a.d_head ** -0.25
    return torch.exp(a.omega @ x - 0.5 * (x ** 2).sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_performer_matches_literal_feature_formula(causal, masked):
    torch.manual_seed(0)
    a = build_attention("performer", D, H, causal=causal, chunk=2).double().eval()
    a.eps = 1e-300  # the stabilised features rescale the normaliser, so compare the exact ratios
    x = torch.randn(2, 7, D, dtype=torch.float64)
    mask = MASK if masked else None
    with torch.no_grad():
        ref = naive_kernel_attention(a, x, mask, lambda qh, kh, *_: favor_phi(a, qh) @ favor_phi(a, kh), eps=1e-300)
        y, _ = a(x, mask)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-5)


def test_features_estimate_the_softmax_kernel():
    g = torch.Generator().manual_seed(0)
    d, m = 4, 8192
    omega = orthogonal_gaussian(m, d, generator=g, dtype=torch.float64)
    q, k = 0.5 * torch.randn(5, d, generator=g, dtype=torch.float64), 0.5 * torch.randn(5, d, generator=g, dtype=torch.float64)

    def phi(x):
        x = x * d ** -0.25
        return torch.exp(x @ omega.T - 0.5 * (x ** 2).sum(-1, keepdim=True)) / math.sqrt(m)

    est, exact = phi(q) @ phi(k).T, torch.exp(q @ k.T / math.sqrt(d))
    assert ((est - exact).abs() / exact).max() < 0.1


def test_orthogonal_blocks_and_gaussian_norms():
    w = orthogonal_gaussian(10, 4, generator=torch.Generator().manual_seed(0))
    block = w[:4] / w[:4].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(4), atol=1e-5, rtol=0)
    assert not torch.allclose(w[:4].norm(dim=1), w[4:8].norm(dim=1))  # chi-distributed, not unit


def test_features_are_fixed_until_redrawn():
    a = build_attention("performer", D, H, causal=True)
    x = torch.randn(1, 5, D)
    before = a.omega.clone()
    y1, _ = a(x)
    y2, _ = a(x)
    torch.testing.assert_close(y1, y2)
    assert "omega" in a.state_dict()
    a.redraw(torch.Generator().manual_seed(5))
    assert not torch.equal(a.omega, before)


def test_redraw_every_n_training_calls_only():
    a = build_attention("performer", D, H, redraw_every=2)
    x = torch.randn(1, 4, D)
    w0 = a.omega.clone()
    a.train()
    a(x)
    assert torch.equal(a.omega, w0)
    a(x)
    assert not torch.equal(a.omega, w0)
    w1 = a.omega.clone()
    a.eval()
    a(x), a(x)
    assert torch.equal(a.omega, w1)


def test_default_feature_count_and_bad_arguments():
    assert build_attention("performer", 64, 2).n_features == int(32 * math.log(32))
    with pytest.raises(ValueError, match="n_features"):
        build_attention("performer", D, H, n_features=0)
    with pytest.raises(ValueError, match="redraw_every"):
        build_attention("performer", D, H, redraw_every=-1)


# -- cosformer --------------------------------------------------------------------------------

def real_pos(mask, b, i):
    """1-based index of token i among the real tokens of sequence b."""
    return i + 1 if mask is None else int(mask[b, : i + 1].sum())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_cosformer_matches_reweighted_relu_kernel(causal, masked):
    torch.manual_seed(0)
    a = build_attention("cosformer", D, H, causal=causal, max_len=10, chunk=3).eval()
    x = torch.randn(2, 7, D)
    mask = MASK if masked else None

    def score(qh, kh, b, i, j, h):
        M = a.max_len if causal else (7 if mask is None else int(mask[b].sum()))
        w = math.cos(math.pi / 2 * (real_pos(mask, b, i) - real_pos(mask, b, j)) / M)
        return F.relu(qh) @ F.relu(kh) * w

    with torch.no_grad():
        ref = naive_kernel_attention(a, x, mask, score)
        y, _ = a(x, mask)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_cosformer_causal_positions_beyond_max_len_are_an_error():
    a = build_attention("cosformer", D, H, causal=True, max_len=4)
    a(torch.randn(1, 4, D))
    with pytest.raises(ValueError, match="max_len"):
        a(torch.randn(1, 5, D))  # (the recurrent form gives NaN instead: test_recurrent.py)


# -- kerformer --------------------------------------------------------------------------------

def kerformer_gate(a, zrow):
    """SE excitation without ReLU on the D channels: sigmoid(W2 W1 z)."""
    l1, l2 = a.se_gate
    return torch.sigmoid(l2(l1(zrow)))


def kerformer_score(a, x, mask, k_all):
    """score(i, j) = sigmoid(q_i)^T (K'_j * gate_j) from the paper's formula."""
    dh = D // H
    B, T, _ = x.shape

    def kprime(b, j):  # softmax(K) of token j, all heads, [H, dh]
        return torch.softmax(k_all[b, j].view(H, dh), -1)

    def gate(b, j):
        real = [t for t in range(T) if (mask is None or mask[b, t]) and (not a.causal or t <= j)]
        z = torch.stack([kprime(b, t) for t in real]).mean(0)
        return kerformer_gate(a, z.flatten()).view(H, dh)

    def score(qh, kh, b, i, j, h):
        return torch.sigmoid(qh) @ (kprime(b, j)[h] * gate(b, j)[h])

    return score


@pytest.mark.parametrize("causal", [False, True])
def test_kerformer_matches_naive_reference(causal):
    torch.manual_seed(0)
    a = build_attention("kerformer", D, H, causal=causal, chunk=3).eval()
    x = torch.randn(2, 7, D)
    with torch.no_grad():
        k_all = a.qkv(x).split(D, -1)[1]
        ref = naive_kernel_attention(a, x, MASK, kerformer_score(a, x, MASK, k_all))
        y, _ = a(x, MASK)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_kerformer_bad_options():
    with pytest.raises(ValueError, match="se_reduction"):
        build_attention("kerformer", D, H, se_reduction=0)
