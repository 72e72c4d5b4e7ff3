"""Primal-Attention against a naive reference written from the paper's formulas (Chen et al. 2023, Primal-Attention)."""

import pytest
import torch
import torch.nn.functional as F

from primal_dt.attention import build_attention
from primal_dt.attention.primal import evenly_spaced_rows

D, H, S = 16, 2, 5
dh = D // H


def heads(a, x):
    qk = a.qk(x)
    return qk[..., :D], qk[..., D:]


def naive_primal(a, x, mask, rows=None):
    """Per sequence, per head, per token, with explicit sums; causal uses means over real prefix."""
    B, T, _ = x.shape
    q, k = heads(a, x)
    out = torch.zeros(B, T, D)
    for b in range(B):
        real = [t for t in range(T) if mask is None or mask[b, t]]
        for t in real:
            if a.causal:
                seen = [j for j in real if j <= t and (a.window is None or t - j < a.window)]
                qt, kt = q[b, seen].mean(0), k[b, seen].mean(0)
            else:
                qt, kt = q[b, t], k[b, t]
            per_head = []
            for h in range(H):
                sl = slice(h * dh, (h + 1) * dh)
                We, Wr = a.W[0][h], a.W[1][h]
                if a.data_dependent:
                    f = rows[b][:, sl]  # [n, dh]
                    We, Wr = f.T @ a.W[0][h, : f.shape[0]], f.T @ a.W[1][h, : f.shape[0]]
                e = We.T @ (qt[sl] / qt[sl].norm())
                r = Wr.T @ (kt[sl] / kt[sl].norm())
                per_head.append(a.Wo(torch.cat([e, r])))
            out[b, t] = a.proj(torch.cat(per_head))
    return out


def make(**kw):
    torch.manual_seed(3)
    return build_attention("primal", D, H, s=S, **kw).eval()


MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)


@pytest.mark.parametrize("kw", [dict(causal=False), dict(causal=True), dict(causal=True, window=3)],
                         ids=["bidir", "causal", "causal-window"])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_naive_reference(kw, masked):
    a = make(**kw)
    x = torch.randn(2, 8, D)
    mask = MASK if masked else None
    y, aux = a(x, mask)
    torch.testing.assert_close(y, naive_primal(a, x, mask), atol=1e-5, rtol=1e-5)
    assert aux["e"].shape == aux["r"].shape == (2, H, 8, S)
    assert aux["Lambda"] is a.Lambda


def naive_rows(x, mask, n_max):
    """f(X): n = min(n_max, L) evenly spaced real rows (floor of linspace over real positions)."""
    rows = []
    for b in range(x.shape[0]):
        real = [t for t in range(x.shape[1]) if mask is None or mask[b, t]]
        n = min(n_max, len(real))
        idx = [real[(j * (len(real) - 1)) // max(n - 1, 1)] for j in range(n)]
        rows.append(x[b, idx])
    return rows


@pytest.mark.parametrize("masked", [False, True])
def test_data_dependent_matches_naive_reference(masked):
    a = make(data_dependent=True, rank_multi=1)  # n_max = 5 rows out of 8
    x = torch.randn(2, 8, D)
    mask = MASK if masked else None
    y, aux = a(x, mask)
    rows = naive_rows(x, mask, S)
    torch.testing.assert_close(y, naive_primal(a, x, mask, rows), atol=1e-5, rtol=1e-5)
    # the KSVD reads the parameters' rows this input used (n = 5), not the per-sample f(X)^T We
    torch.testing.assert_close(aux["We"], a.W[0][:, :5], rtol=0, atol=0)
    torch.testing.assert_close(aux["Wr"], a.W[1][:, :5], rtol=0, atol=0)


def test_evenly_spaced_rows_never_sample_padding():
    x = torch.arange(10.0).view(1, 10, 1).expand(2, 10, 1).clone()
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 2:9] = True  # 7 real tokens at 2..8
    mask[1, [1, 4, 7]] = True  # 3 real tokens
    rows = evenly_spaced_rows(x, mask, 4).squeeze(-1)
    assert rows[0].tolist() == [2.0, 4.0, 6.0, 8.0]
    assert rows[1].tolist() == [1.0, 4.0, 7.0, 0.0]  # only 3 real rows; the 4th is a zero row


def test_data_dependent_causal_is_refused():
    with pytest.raises(ValueError, match="data_dependent=True .* would see the future"):
        build_attention("primal", D, H, causal=True, s=S, data_dependent=True)


@pytest.mark.parametrize("bad,match", [(dict(s=0), "s must be >= 1"), (dict(s=D + 1), "exceed d_model"),
                                       (dict(s=2.5), "s must be an integer"), (dict(rank_multi=0), "rank_multi"),
                                       (dict(window=3), "window applies to causal")])
def test_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        build_attention("primal", D, H, **{"s": S, **bad})


def test_recurrent_state_is_constant_size():
    form = make(causal=True).recurrent()
    st = form.init(3)
    for _ in range(50):
        _, st = form(torch.randn(3, 2, D), st)
    assert [s.shape for s in st] == [(3, 2 * H * dh)]  # the running sum of q|k, per row


def test_bidirectional_data_independent_output_is_tokenwise():
    """The primal form forms no kernel matrix: each token's output depends on that token only."""
    a = make()
    x = torch.randn(1, 6, D)
    y, _ = a(x)
    y1, _ = a(x[:, 2:3])
    torch.testing.assert_close(y[:, 2:3], y1)
    assert F.cosine_similarity(y[0, 0], y[0, 1], dim=0) < 0.999
