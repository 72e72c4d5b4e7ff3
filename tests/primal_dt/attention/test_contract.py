"""The attention contract (primal_dt/attention/base.py), checked for every registered mechanism and direction.

Per mechanism: padding never influences real tokens (either side) and padding outputs are zero;
causal outputs ignore the future; gradients pass gradcheck; bad input gets a ValueError naming the
argument. The recurrent forms: test_recurrent.py (against forward and naive.py). Mechanism-specific
naive-formula tests live in the mechanism's own test file.
"""

from __future__ import annotations

import pytest
import torch

from primal_dt.attention import available, build_attention, get_class

D, H = 16, 2
#: options that keep each mechanism small enough for these tests (defaults otherwise)
OPTIONS = {"primal": {"s": 6}}


def cases():
    out = []
    for name in available():
        cls = get_class(name)
        for causal in (False, True):
            if (causal and cls.supports_causal) or (not causal and cls.supports_bidirectional):
                out.append(pytest.param(name, causal, id=f"{name}-{'causal' if causal else 'bidir'}"))
    return out


def make(name, causal, dtype=torch.float32, **extra):
    torch.manual_seed(0)
    m = build_attention(name, D, H, causal=causal, **{**OPTIONS.get(name, {}), **extra})
    return m.to(dtype).eval()


def rand_mask(B, T, gen, p=0.3):
    m = torch.rand(B, T, generator=gen) > p
    m[:, 0] |= ~m.any(1)  # at least one real token per row
    return m


@pytest.mark.parametrize("name,causal", cases())
def test_padding_outputs_are_zero_and_finite(name, causal):
    a = make(name, causal)
    x = torch.randn(3, 9, D)
    mask = rand_mask(3, 9, torch.Generator().manual_seed(1))
    y, _ = a(x, mask)
    assert y.shape == x.shape
    assert torch.isfinite(y).all()
    assert (y[~mask] == 0).all()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name,causal", cases())
def test_padding_invariance(name, causal, side):
    a = make(name, causal)
    L, P = 7, 5
    x = torch.randn(2, L, D)
    ref, _ = a(x)
    junk = 10 * torch.randn(2, P, D)
    xp = torch.cat([x, junk], 1) if side == "right" else torch.cat([junk, x], 1)
    mask = torch.ones(2, L + P, dtype=torch.bool)
    if side == "right":
        mask[:, L:] = False
    else:
        mask[:, :P] = False
    y, _ = a(xp, mask)
    real = y[:, :L] if side == "right" else y[:, P:]
    torch.testing.assert_close(real, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,causal", [c for c in cases() if c.values[1]])
def test_causal_outputs_ignore_the_future(name, causal):
    a = make(name, causal)
    x = torch.randn(2, 10, D)
    y, _ = a(x)
    x2 = x.clone()
    x2[:, 6:] = torch.randn(2, 4, D)
    y2, _ = a(x2)
    torch.testing.assert_close(y2[:, :6], y[:, :6], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(y2[:, 6:], y[:, 6:])


@pytest.mark.parametrize("name,causal", cases())
def test_gradcheck(name, causal):
    a = make(name, causal, dtype=torch.float64)
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    assert torch.autograd.gradcheck(lambda inp: a(inp, mask)[0], (x,), eps=1e-6, atol=1e-4)


@pytest.mark.parametrize("name,causal", cases())
def test_bad_input_is_a_clear_value_error(name, causal):
    a = make(name, causal)
    with pytest.raises(ValueError, match="x must have shape"):
        a(torch.randn(4, D))
    with pytest.raises(ValueError, match="x must have shape"):
        a(torch.randn(2, 4, D + 1))
    with pytest.raises(ValueError, match="mask must have shape"):
        a(torch.randn(2, 4, D), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a bool"):
        a(torch.randn(2, 4, D), torch.ones(2, 4))


def test_unknown_mechanism_names_the_registry():
    with pytest.raises(ValueError, match=r"unknown attention mechanism 'primall'.*Did you mean 'primal'"):
        build_attention("primall", D, H)


def test_unknown_option_lists_accepted_ones():
    with pytest.raises(ValueError, match=r"does not accept option\(s\) \['rank'\].*accepted"):
        build_attention("primal", D, H, rank=3)


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        build_attention("softmax", 10, 3)


@pytest.mark.parametrize("kind", ["softmax", "softmax-w3", "primal", "primal-bidirectional", "primal-w3"])
def test_the_probe_reads_the_explicit_matrix(kind):
    """The tests' probe (probe.py: one-hot values, or one-hot projection directions for primal, through the
    mechanism's own forward) gives the matrix written from the formula (naive.py): softmax's weights,
    primal's induced kernel phi(qbar) phi(kbar)^T; rows and columns of padding zero."""
    from .probe import attention_matrix

    from .naive import primal_features, softmax_weights

    name, _, rest = kind.partition("-")
    causal = rest != "bidirectional"
    opts = {"window": int(rest[1:])} if rest.startswith("w") else {}
    torch.manual_seed(0)
    a = build_attention(name, 16, 2, causal=causal, **({"s": 3} if name == "primal" else {}), **opts).double().eval()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[0, :2] = mask[1, 8:] = False
    with torch.no_grad():
        if name == "softmax":
            ref = softmax_weights(a, x, mask)
        else:
            fq, fk = primal_features(a, x, mask)
            ref = fq @ fk.transpose(-1, -2)
    ref = ref * (mask[:, None, :, None] & mask[:, None, None, :])
    torch.testing.assert_close(attention_matrix(a, x, mask), ref, atol=1e-10, rtol=1e-9)
