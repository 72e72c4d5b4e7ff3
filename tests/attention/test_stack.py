"""The transformer stack: layouts are data, and the recurrent stack reproduces the parallel one."""

import pytest
import torch

from primal_dt.blocks import LayerSpec, Stack
from primal_dt.ksvd import ksvd_regularizer
from primal_dt.layouts import layout

D, H = 16, 2
OPTS = {"primal": {"s": 6}}


def make(model, norm="pre", n=3):
    torch.manual_seed(0)
    return Stack(D, H, layout(model, n, OPTS), causal=True, dropout=0.1, norm=norm).eval()


def test_layouts():
    assert [s.attention for s in layout("dt", 3)] == ["softmax"] * 3
    assert [s.attention for s in layout("primal+dt", 3)] == ["softmax", "softmax", "primal"]
    assert [s.attention for s in layout("primalformer-dt", 2)] == ["primal", "primal"]
    assert [s.attention for s in layout("primal+trans", 2)] == ["softmax", "primal"]
    assert layout("primal+dt", 2, OPTS)[1].options == {"s": 6}
    with pytest.raises(ValueError, match="unknown model layout 'primalformerr'"):
        layout("primalformerr", 2)
    with pytest.raises(ValueError, match="n_layers must be >= 1"):
        layout("dt", 0)


@pytest.mark.parametrize("model", ["dt", "primal+dt", "primalformer-dt"])
@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_stack_step_equals_forward(model, norm, chunk):
    s = make(model, norm)
    x = torch.randn(2, 15, D)
    mask = torch.ones(2, 15, dtype=torch.bool)
    mask[0, 11:] = False  # right padding
    mask[1, :4] = False  # left padding
    ref, _ = s(x, mask)
    st = s.init_state(2)
    outs = []
    for t in range(0, 15, chunk):
        y, st = s.step(x[:, t:t + chunk], st, mask[:, t:t + chunk])
        outs.append(y)
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", ["dt", "primal+dt", "primalformer-dt"])
def test_stack_padding_invariance(model):
    s = make(model)
    x = torch.randn(2, 6, D)
    ref, _ = s(x)
    xp = torch.cat([x, torch.randn(2, 4, D)], 1)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[:, 6:] = False
    y, auxes = s(xp, mask)
    torch.testing.assert_close(y[:, :6], ref, atol=1e-5, rtol=1e-5)
    assert len(auxes) == 3 and ("Lambda" in auxes[-1]) == (model != "dt")


def test_stack_gradients_reach_every_layer():
    s = make("primal+dt")
    s.train()
    y, auxes = s(torch.randn(2, 5, D))
    (y.sum() + ksvd_regularizer(auxes, 0.05)).backward()
    assert all(p.grad is not None for p in s.parameters() if p.requires_grad)


def test_bad_stack_arguments():
    with pytest.raises(ValueError, match="at least one layer"):
        Stack(D, H, [])
    with pytest.raises(ValueError, match="norm must be"):
        Stack(D, H, ["softmax"], norm="mid")
    with pytest.raises(ValueError, match="recurrent stepping needs a causal stack"):
        Stack(D, H, [LayerSpec("softmax")], causal=False).init_state(1)
