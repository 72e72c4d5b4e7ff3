"""The transformer stack: layouts are data, and the recurrent stack reproduces the parallel one."""

import copy

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
    assert [s.attention for s in layout("trans", 3)] == ["softmax"] * 3
    assert [s.attention for s in layout("primal+trans", 3)] == ["softmax", "softmax", "primal"]
    assert [s.attention for s in layout("primalformer", 2)] == ["primal", "primal"]
    assert [s.attention for s in layout("primal+trans", 2)] == ["softmax", "primal"]
    assert layout("primal+trans", 2, OPTS)[1].options == {"s": 6}
    with pytest.raises(ValueError, match="unknown model layout 'primalformerr'"):
        layout("primalformerr", 2)
    with pytest.raises(ValueError, match="n_layers must be >= 1"):
        layout("trans", 0)
    for dt_name in ("dt", "bc", "primalformer-dt"):  # a model's own names are its model's to parse
        with pytest.raises(ValueError, match="unknown model layout"):
            layout(dt_name, 2)


@pytest.mark.parametrize("model", ["trans", "primal+trans", "primalformer"])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_stack_recurrent_form_equals_forward(model, chunk):
    s = make(model)
    x = torch.randn(2, 15, D)
    mask = torch.ones(2, 15, dtype=torch.bool)
    mask[0, 11:] = False  # right padding
    mask[1, :4] = False  # left padding
    with torch.no_grad():
        ref, _ = s(x, mask)
        form = s.recurrent(window=15, chunk=chunk)  # a window as long as the sequence: unbounded attention
        st, outs = form.init(2), []
        for t in range(0, 15, chunk):
            y, st = form(x[:, t:t + chunk], st, mask[:, t:t + chunk])
            outs.append(y)
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", ["trans", "primal+trans", "primalformer"])
@pytest.mark.parametrize("last_only", [False, True])
def test_stack_stream_equals_forward(model, last_only):
    """The stream form (each block's pre-norm residual around its mechanism's stream form) in chunks of
    three, the first token padding in one row, equals forward on the copy whose unbounded softmax
    layers adopt the stream's window; with last_only, the chunk's last token only."""
    s = make(model)
    x = torch.randn(2, 18, D)
    mask = torch.ones(2, 18, dtype=torch.bool)
    mask[0, 0] = False
    twin = copy.deepcopy(s)
    for b in twin.blocks:
        b.attn.adopt_stream_window(8)
    with torch.no_grad():
        ref, _ = twin(x, mask)
        form = s.recurrent(window=8, chunk=3)
        st, outs = form.init(2), []
        for t in range(0, 18, 3):
            y, st = form(x[:, t:t + 3], st, mask[:, t:t + 3] if t == 0 else None, last_only)
            outs.append(y)
    got = torch.cat(outs, 1)
    if last_only:
        torch.testing.assert_close(got, ref[:, 2::3], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=1e-5)


def test_softmax_rings_of_one_size_share_their_flags_and_phase():
    """Rings of one size advance their flags and phase alike (from the chunks and their mask alone): the stack
    holds them once, under the first layer, a ring of another size keeps its own, and the stream still equals
    forward, padding included."""
    torch.manual_seed(0)
    s = Stack(D, H, [LayerSpec("softmax", {"window": 4}), LayerSpec("softmax", {"window": 6}), LayerSpec("softmax")],
              causal=True, dropout=0.0).eval()
    form = s.recurrent(window=4, chunk=2)
    assert [(p.name, p.masked_by) for p in form.specs] == [
        ("layer0.k", "layer0.valid"), ("layer0.v", "layer0.valid"), ("layer0.valid", ""), ("layer0.pos", ""),
        ("layer1.k", "layer1.valid"), ("layer1.v", "layer1.valid"), ("layer1.valid", ""), ("layer1.pos", ""),
        ("layer2.k", "layer0.valid"), ("layer2.v", "layer0.valid")]
    twin = copy.deepcopy(s)
    for b in twin.blocks:
        b.attn.adopt_stream_window(4)
    x, mask = torch.randn(2, 12, D), torch.ones(2, 12, dtype=torch.bool)
    mask[0, :3] = False
    with torch.no_grad():
        ref, _ = twin(x, mask)
        st, outs = form.init(2), []
        for t in range(0, 12, 2):
            y, st = form(x[:, t:t + 2], st, mask[:, t:t + 2])
            outs.append(y)
    torch.testing.assert_close(torch.cat(outs, 1)[mask], ref[mask], atol=1e-5, rtol=1e-5)


def test_post_norm_stack_does_not_stream():
    with pytest.raises(ValueError, match=r"layer 0 \(softmax\): a post-norm block"):
        make("primal+trans", norm="post").recurrent(window=8)


@pytest.mark.parametrize("model", ["trans", "primal+trans", "primalformer"])
def test_stack_padding_invariance(model):
    s = make(model)
    x = torch.randn(2, 6, D)
    ref, _ = s(x)
    xp = torch.cat([x, torch.randn(2, 4, D)], 1)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[:, 6:] = False
    y, auxes = s(xp, mask)
    torch.testing.assert_close(y[:, :6], ref, atol=1e-5, rtol=1e-5)
    assert len(auxes) == 3 and ("Lambda" in auxes[-1]) == (model != "trans")


@pytest.mark.parametrize("model", ["trans", "primal+trans", "primalformer"])
@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("rows", [slice(1, None, 3), torch.tensor([0, 4, 5, 8])])
def test_rows_are_the_full_outputs_there_with_the_same_gradients(model, norm, rows):
    """``rows``: the top block's residual and MLP only where they are read. Outputs at those rows, the
    regulariser's aux and every gradient equal the full forward's (dropout off: it draws per row)."""
    s = make(model, norm=norm)
    for mod in s.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    s.train()
    x = torch.randn(2, 9, D)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 7:] = False

    def run(**kw):
        s.zero_grad()
        xi = x.clone().requires_grad_()
        y, auxes = s(xi, mask, **kw)
        y = y if kw else y[:, rows]
        (y.pow(2).sum() + ksvd_regularizer(auxes, 0.05)).backward()
        return y.detach(), xi.grad, [p.grad.clone() for p in s.parameters()]

    y, gx, grads = run(rows=rows)
    ref_y, ref_gx, ref_grads = run()
    assert y.shape == (2, len(range(9)[rows]) if isinstance(rows, slice) else len(rows), D)
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, ref_gx, atol=1e-5, rtol=1e-5)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)


def test_stack_gradients_reach_every_layer():
    s = make("primal+trans")
    s.train()
    y, auxes = s(torch.randn(2, 5, D))
    (y.sum() + ksvd_regularizer(auxes, 0.05)).backward()
    assert all(p.grad is not None for p in s.parameters() if p.requires_grad)


def test_bad_stack_arguments():
    with pytest.raises(ValueError, match="at least one layer"):
        Stack(D, H, [])
    with pytest.raises(ValueError, match="norm must be"):
        Stack(D, H, ["softmax"], norm="mid")
    with pytest.raises(ValueError, match=r"layer 0 \(softmax\): .*no recurrent form when causal=False"):
        Stack(D, H, [LayerSpec("softmax")], causal=False).recurrent(window=8)
