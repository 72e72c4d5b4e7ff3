"""Softmax attention against an explicit-loop reference written from the formula."""

import math

import pytest
import torch

from primal_dt.attention import build_attention

D, H = 12, 3


def naive_softmax(a, x, mask, causal, window):
    """Loop over queries: softmax over the keys it may see, weights times values."""
    B, T, _ = x.shape
    dh = D // H
    q, k, v = a.qkv(x).split(D, dim=-1)
    out = torch.zeros(B, T, D)
    for b in range(B):
        for t in range(T):
            if mask is not None and not mask[b, t]:
                continue
            for h in range(H):
                sl = slice(h * dh, (h + 1) * dh)
                keys = [j for j in range(T) if (mask is None or mask[b, j])
                        and (not causal or j <= t)
                        and (window is None or (abs(t - j) < window if not causal else t - j < window))]
                s = torch.stack([q[b, t, sl] @ k[b, j, sl] / math.sqrt(dh) for j in keys])
                w = torch.softmax(s, 0)
                out[b, t, sl] = sum(w[i] * v[b, j, sl] for i, j in enumerate(keys))
    return a.proj(out) * (mask.unsqueeze(-1) if mask is not None else 1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_naive_reference(causal, window, masked):
    torch.manual_seed(1)
    a = build_attention("softmax", D, H, causal=causal, window=window).eval()
    x = torch.randn(2, 8, D)
    mask = None
    if masked:
        mask = torch.ones(2, 8, dtype=torch.bool)
        mask[0, 6:] = False
        mask[1, :2] = False
        mask[1, 4] = False
    y, aux = a(x, mask)
    assert aux == {}
    torch.testing.assert_close(y, naive_softmax(a, x, mask, causal, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_materialized_equals_fused(causal):
    torch.manual_seed(2)
    a = build_attention("softmax", D, H, causal=causal, window=None).eval()
    b = build_attention("softmax", D, H, causal=causal, impl="materialized").eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 9, D)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    for m in (None, mask):
        torch.testing.assert_close(b(x, m)[0], a(x, m)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="impl must be"):
        build_attention("softmax", D, H, impl="flash")


@pytest.mark.parametrize("window", [None, 3])
def test_auto_materializes_short_bf16_cpu_calls_and_fuses_the_rest(window, monkeypatch):
    """``impl="auto"`` (the default) is the materialized form for bf16 scores on a CPU while a call's fit
    MATERIALIZE_MAX elements, and SDPA for float32 scores and past that size; each path gives its form's outputs."""
    from primal_dt.attention import softmax

    torch.manual_seed(3)
    auto = build_attention("softmax", D, H, causal=True, window=window).eval()
    forms = {impl: build_attention("softmax", D, H, causal=True, window=window, impl=impl).eval()
             for impl in ("sdpa", "materialized")}
    for f in forms.values():
        f.load_state_dict(auto.state_dict())
    assert auto.impl == "auto"
    calls = []
    real = softmax.F.scaled_dot_product_attention
    monkeypatch.setattr(softmax.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(2, 9, D)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False

    def run(module, m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(x, m)[0]

    for m in (None, mask):
        calls.clear()
        y = run(auto, m)
        assert calls == []  # 2 x 3 x 9 x 9 bf16 scores: materialized
        assert torch.equal(y, run(forms["materialized"], m))
        calls.clear()
        torch.testing.assert_close(auto(x, m)[0], forms["sdpa"](x, m)[0], atol=0, rtol=0)  # float32: SDPA
        assert len(calls) == 2
    monkeypatch.setattr(softmax, "MATERIALIZE_MAX", 2 * H * 9 * 9 - 1)  # one element too many: the fused kernel
    calls.clear()
    assert torch.equal(run(auto, None), run(forms["sdpa"], None)) and len(calls) == 2


def test_windowed_cache_stays_bounded():
    a = build_attention("softmax", D, H, causal=True, window=4).eval()
    form = a.recurrent()  # one-token chunks: a ring of the window's 4 slots
    st = form.init(2)
    for _ in range(20):
        _, st = form(torch.randn(2, 1, D), st)
    assert st[0].shape[2] == 4 and st[3].tolist() == [0, 0]  # (20 tokens: the phase is back at slot 0)


def test_bad_window():
    with pytest.raises(ValueError, match="window must be >= 1"):
        build_attention("softmax", D, H, causal=True, window=0)
