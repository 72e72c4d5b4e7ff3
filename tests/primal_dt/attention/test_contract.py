"""The attention contract (DESIGN.md), checked for every registered mechanism and direction.

Per mechanism: padding never influences real tokens (either side) and padding outputs are zero;
causal outputs ignore the future; the recurrent form reproduces the parallel form token by token
and in arbitrary chunks, with arbitrary padding masks, to 1e-5; gradients pass gradcheck; bad
input gets a ValueError naming the argument. Mechanism-specific naive-formula tests live in the
mechanism's own test file.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def step_cases():
    return [c for c in cases() if c.values[1] and get_class(c.values[0]).supports_step]


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


def run_steps(a, x, mask, sizes):
    state = a.init_state(x.shape[0])
    outs, t = [], 0
    for c in sizes:
        y, state = a.step(x[:, t : t + c], state, None if mask is None else mask[:, t : t + c])
        outs.append(y)
        t += c
    return torch.cat(outs, 1)


@pytest.mark.parametrize("name,causal", step_cases())
def test_step_token_by_token_equals_forward(name, causal):
    a = make(name, causal)
    x = torch.randn(3, 12, D)
    mask = rand_mask(3, 12, torch.Generator().manual_seed(2))
    ref, _ = a(x, mask)
    got = run_steps(a, x, mask, [1] * 12)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,causal", step_cases())
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_step_in_chunks_equals_forward(name, causal, data):
    B = data.draw(st.integers(1, 3), label="B")
    T = data.draw(st.integers(1, 16), label="T")
    sizes, left = [], T
    while left:
        c = data.draw(st.integers(1, left), label="chunk")
        sizes.append(c)
        left -= c
    seed = data.draw(st.integers(0, 10_000), label="seed")
    window = data.draw(st.one_of(st.none(), st.integers(1, 6)), label="window") if get_class(name).supports_window else None
    g = torch.Generator().manual_seed(seed)
    a = make(name, causal, **({"window": window} if window else {}))
    x = torch.randn(B, T, D, generator=g)
    mask = rand_mask(B, T, g) if data.draw(st.booleans(), label="masked") else None
    ref, _ = a(x, mask)
    got = run_steps(a, x, mask, sizes)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,causal", step_cases())
def test_reset_rows_restarts_only_selected_sequences(name, causal):
    a = make(name, causal)
    x = torch.randn(2, 8, D)
    state = a.init_state(2)
    _, state = a.step(x[:, :5], state)
    a.reset_rows(state, torch.tensor([True, False]))
    y, _ = a.step(x[:, 5:], state)
    fresh, _ = a(x[:1, 5:])  # row 0 restarted: as if its sequence began at token 5
    full, _ = a(x[1:])
    torch.testing.assert_close(y[:1], fresh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[1:], full[:, 5:], atol=1e-5, rtol=1e-5)


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


@pytest.mark.parametrize("name", [n for n in available() if not get_class(n).supports_step or not get_class(n).supports_causal])
def test_no_recurrent_form_is_a_clear_error(name):
    cls = get_class(name)
    a = make(name, not cls.supports_bidirectional)
    with pytest.raises(ValueError, match="recurrent"):
        a.init_state(1)


def test_stepping_a_bidirectional_mechanism_is_a_clear_error():
    a = make("primal", causal=False)
    with pytest.raises(ValueError, match="no recurrent form when causal=False"):
        a.init_state(2)
