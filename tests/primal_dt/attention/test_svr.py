"""Attention-BN / -SH / -BN+SH (primal-dual SVR framework) against the formulas, written per token."""

import math

import pytest
import torch
import torch.nn.functional as F

from primal_dt.attention import build_attention
from primal_dt.attention.svr import default_factors

D, H = 8, 2
dh = D // H
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)


def elu1(z):
    return F.elu(z) + 1


def naive_svr(a, x, mask):
    B, T, _ = x.shape
    q, k, v = a.qkv(x).split(D, -1)
    out = torch.zeros(B, T, D, dtype=x.dtype)
    for b in range(B):
        R = [t for t in range(T) if mask is None or mask[b, t]]
        for h in range(H):
            sl, r = slice(h * dh, (h + 1) * dh), a.factors[h]
            K, V, Q = k[b, R, sl], v[b, R, sl], q[b, R, sl]  # real tokens, in order
            for p, t in enumerate(R):
                if not a.causal:
                    keys = [K[g:g + r].mean(0) for g in range(0, len(R), r)]  # last group may be partial
                    vals = [V[g:g + r].mean(0) for g in range(0, len(R), r)]
                    P = torch.stack(keys)
                    q_stats = P.mean(0)
                    key_stats = [q_stats] * len(keys)
                else:
                    g = p // r
                    keys = [K[j * r:(j + 1) * r].mean(0) for j in range(g)] + [K[g * r:p + 1].mean(0)]
                    vals = [V[j * r:(j + 1) * r].mean(0) for j in range(g)] + [V[g * r:p + 1].mean(0)]

                    def stats(upto):  # token-level mean of the real prefix R[:upto + 1]
                        return K[:upto + 1].mean(0)

                    q_stats = stats(p)
                    # softmax: every key re-centred by the query's prefix; linear: by its own prefix
                    key_stats = ([q_stats] * len(keys) if a.kernel == "softmax"
                                 else [stats((j + 1) * r - 1) for j in range(g)] + [q_stats])

                def shift(z, mu):
                    return z - a.beta * mu if a.use_bn else z

                qs = shift(Q[p], q_stats)
                if a.kernel == "softmax":
                    scores = torch.stack([qs @ shift(kk, q_stats) / math.sqrt(dh) for kk in keys])
                    out[b, t, sl] = torch.softmax(scores, 0) @ torch.stack(vals)
                else:
                    w = torch.stack([elu1(qs) @ elu1(shift(kk, st)) for kk, st in zip(keys, key_stats)])
                    out[b, t, sl] = (w @ torch.stack(vals)) / (w.sum() + 1e-6)
    return a.proj(out) * (1 if mask is None else mask[..., None].to(x.dtype))


VARIANTS = [("svr-bn", {}), ("svr-bn", {"beta": 0.8}), ("svr-sh", {}), ("svr-sh", {"factors": (3, 2)}),
            ("svr-bn-sh", {})]


@pytest.mark.parametrize("name,opts", VARIANTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(VARIANTS)])
@pytest.mark.parametrize("kernel", ["softmax", "linear"])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_naive_reference(name, opts, kernel, causal):
    torch.manual_seed(0)
    a = build_attention(name, D, H, causal=causal, kernel=kernel, **opts).double().eval()
    x = torch.randn(2, 8, D, dtype=torch.float64)
    with torch.no_grad():
        for mask in (None, MASK):
            y, _ = a(x, mask)
            torch.testing.assert_close(y, naive_svr(a, x, mask), atol=1e-8, rtol=1e-7)


@pytest.mark.parametrize("kernel", ["softmax", "linear"])
def test_recurrent_equals_parallel_with_pooling(kernel):
    a = build_attention("svr-bn-sh", D, H, causal=True, kernel=kernel, factors=(3, 2)).eval()
    x = torch.randn(2, 11, D)
    mask = torch.rand(2, 11, generator=torch.Generator().manual_seed(3)) > 0.3
    ref, _ = a(x, mask)
    form = a.recurrent()
    state, outs, t = form.init(2), [], 0
    for c in (2, 1, 4, 1, 3):
        y, state = form(x[:, t:t + c], state, mask[:, t:t + c])
        outs.append(y)
        t += c
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-5, rtol=1e-5)
    assert [s.name for s in form.specs] == ["q", "k", "v", "n"]
    assert state[1].shape[2] == int(mask.sum(1).max())  # the cache holds real tokens only


def test_default_factors_follow_the_paper():
    assert default_factors(8) == (1, 1, 2, 2, 4, 4, 8, 8)
    assert default_factors(2) == (1, 2)
    assert build_attention("svr-sh", D, H).factors == (1, 2)
    assert build_attention("svr-bn", D, H).factors == (1, 1)


def test_bn_changes_outputs_and_beta_zero_is_softmax():
    torch.manual_seed(0)
    x = torch.randn(1, 6, D)
    a = build_attention("svr-bn", D, H, beta=0.0).eval()
    soft = build_attention("softmax", D, H).eval()
    soft.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(x)[0], soft(x)[0], atol=1e-6, rtol=1e-5)
    a.beta = 1.0
    assert not torch.allclose(a(x)[0], soft(x)[0], atol=1e-4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="kernel"):
        build_attention("svr-bn", D, H, kernel="cosine")
    with pytest.raises(ValueError, match="beta"):
        build_attention("svr-bn", D, H, beta="high")
    with pytest.raises(ValueError, match="factors"):
        build_attention("svr-sh", D, H, factors=(1, 2, 4))
    with pytest.raises(ValueError, match="factors entry"):
        build_attention("svr-sh", D, H, factors=(1, 0))
    with pytest.raises(ValueError, match="does not accept"):
        build_attention("svr-bn", D, H, factors=(1, 2))
    with pytest.raises(ValueError, match="does not accept"):
        build_attention("svr-sh", D, H, beta=0.3)
