"""The Decision Transformer: token layout, causality, padding, loss, streaming pieces, checkpoints."""

import pytest
import torch

from agents import DecisionTransformer, DTConfig, dt_checkpoint
from agents.decision_transformer import Batch, action_mse, dt_loss
from primal_dt.run import checkpoint
from primal_dt.attention import available, get_class
from primal_dt.ksvd import ksvd_regularizer

LAYOUTS = ["dt", "primal+dt", "primalformer-dt"]
# every other registered causal mechanism, as an all-layers layout
OTHERS = [n for n in available() if get_class(n).supports_causal and n not in ("softmax", "primal")]
S_DIM, A_DIM, K = 11, 3, 6


def tiny(layout="primal+dt", **kw) -> DecisionTransformer:
    if "layers" in kw:
        kw["layers"] = ",".join(kw["layers"])
    cfg = DTConfig(state_dim=S_DIM, act_dim=A_DIM, K=K, d_model=32, n_heads=2, n_layers=3, name=layout, s=8,
                   dropout=0.0, **kw)
    return DecisionTransformer(cfg).eval()


def batch(B=4, T=K, lengths=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths or []):
        mask[i, n:] = False
    return Batch(states=torch.randn(B, T, S_DIM, generator=g), actions=torch.rand(B, T, A_DIM, generator=g) * 2 - 1,
                 rtg=torch.randn(B, T, 1, generator=g), timesteps=torch.randint(0, 1000, (B, T), generator=g),
                 mask=mask)


def rows(b, fn):
    """``b`` with ``fn`` applied to every tensor (a clone, a slice)."""
    return Batch(*(None if v is None else fn(v) for v in b))


def predict(m, b):
    return m(b)[0]


def test_tokens_are_interleaved_return_state_action():
    m = tiny()
    b = batch()
    x = m.embed(b)
    assert m.tokens.kinds == ("rtg", "state", "action") and m.tokens.predict_from == "state"
    assert x.shape == (4, 3 * K, 32)
    for i, (kind, values) in enumerate((("rtg", b.rtg), ("state", b.states), ("action", b.actions))):
        one = m.embed_tokens([kind], [values], b.timesteps.unsqueeze(-1))[:, :, 0]
        torch.testing.assert_close(x[:, i::3], one)
        torch.testing.assert_close(one, m.embed_ln(getattr(m, f"embed_{'return' if kind == 'rtg' else kind}")(values)
                                                   + m.embed_timestep(b.timesteps)))
    assert m.tokens.token_mask(torch.tensor([[True, False]])).tolist() == [[True] * 3 + [False] * 3]


@pytest.mark.parametrize("layout", LAYOUTS + OTHERS)
def test_action_at_t_sees_only_returns_and_states_up_to_t_and_earlier_actions(layout):
    m = tiny(layout)
    b = batch()
    base = predict(m, b)
    assert base.abs().max() <= 1  # tanh head
    t = 3
    for key, steps in (("actions", slice(t, None)), ("states", slice(t + 1, None)), ("rtg", slice(t + 1, None))):
        c = rows(b, torch.clone)
        getattr(c, key)[:, steps] += 5.0
        out = predict(m, c)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=1e-5, rtol=0)
        assert not torch.allclose(out[:, t + 1:], base[:, t + 1:])  # later steps do see them
    c = rows(b, torch.clone)
    c.states[:, t] += 5.0
    assert not torch.allclose(predict(m, c)[:, t], base[:, t])  # the head reads the state token of step t


@pytest.mark.parametrize("layout", LAYOUTS + OTHERS)
def test_padding_after_real_steps_changes_nothing_real(layout):
    m = tiny(layout)
    b = batch(lengths=[K, 4, 2, 1])
    pred, auxes = m(b)
    c = rows(b, torch.clone)
    pad = ~b.mask
    for key in ("states", "actions", "rtg"):
        getattr(c, key)[pad] = 1e3
    c.timesteps[pad] = 999
    pred2, auxes2 = m(c)
    torch.testing.assert_close(pred2[b.mask], pred[b.mask], atol=1e-5, rtol=0)
    l1, p1 = dt_loss(m, b, eta=0.05)
    l2, p2 = dt_loss(m, c, eta=0.05)
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-5)
    # a real-only batch of the same steps gives the same prediction as its padded version
    short = rows(b, lambda v: v[1:2, :4])
    torch.testing.assert_close(predict(m, short)[0], pred[1, :4], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trailing_padding_fast_path_equals_the_masked_stack(layout):
    m = tiny(layout)
    b = batch(lengths=[K, 4, 2, 1])
    pred, auxes = m(b)
    h, ref_auxes = m.stack(m.embed(b), m.tokens.token_mask(b.mask))
    ref = m.predict_action(h[:, 1::3])
    torch.testing.assert_close(pred[b.mask], ref[b.mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.as_tensor(ksvd_regularizer(auxes, 1.0)),
                               torch.as_tensor(ksvd_regularizer(ref_auxes, 1.0)), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_gradients_equal_those_of_the_full_stack(layout):
    """The top block runs only on the predicting tokens (``Stack.forward``'s rows): the loss and every gradient
    are those of the whole stack's output read at the predicting tokens, in training mode (dropout off)."""
    m = tiny(layout).train()
    b = batch(lengths=[K, 4, 2, 1])
    loss, _ = dt_loss(m, b, eta=0.5)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    h, auxes = m.stack(m.embed(b), m.tokens.token_mask(b.mask))
    ref = action_mse(m.predict_action(h[:, 1::3]), b.actions, b.mask) + ksvd_regularizer(auxes, 0.5)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-5)
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-4, msg=lambda msg: f"{n}: {msg}")


def test_other_padding_takes_the_masked_path():
    m = tiny("primal+dt")
    b = batch(B=2)
    b.mask[0, :2] = False  # left padding
    b.mask[1, 3] = False  # a hole
    pred = predict(m, b)
    c = rows(b, torch.clone)
    for key in ("states", "actions", "rtg"):
        getattr(c, key)[~b.mask] = 1e3
    torch.testing.assert_close(predict(m, c)[b.mask], pred[b.mask], atol=1e-5, rtol=0)


def test_loss_is_masked_mse_plus_eta_ksvd():
    m = tiny("primal+dt")
    b = batch(lengths=[K, 3, 5, 2])
    loss, parts = dt_loss(m, b, eta=0.5, detail=True)
    pred, auxes = m(b)
    mse = ((pred - b.actions) ** 2)[b.mask].mean()
    torch.testing.assert_close(parts["mse"], mse)
    torch.testing.assert_close(loss, mse + ksvd_regularizer(auxes, 0.5))
    assert set(k for k in parts if k.startswith("J/")) == {"J/layer2"}  # the last layer is the primal one
    assert float(parts["ksvd"]) > 0
    loss_dt, parts_dt = dt_loss(tiny("dt"), b, eta=0.5, detail=True)
    assert float(parts_dt["ksvd"]) == 0 and not any(k.startswith("J/") for k in parts_dt)
    assert action_mse(pred, b.actions, None) != mse  # padding would count without the mask


def test_layouts_and_explicit_layers():
    assert tiny("dt").layer_names == ["softmax"] * 3
    assert tiny("primal+dt").layer_names == ["softmax", "softmax", "primal"]
    assert tiny("primalformer-dt").layer_names == ["primal"] * 3
    m = tiny(layers=("primal", "dt"))
    assert m.layer_names == ["primal", "softmax"]
    assert m.stack.blocks[0].attn.s == 8


@pytest.mark.parametrize("layout", ["dt", "primal+dt"])
def test_streaming_pieces_reproduce_forward(layout):
    """One env step's tokens at a time through the stack's recurrent form, head on the state token."""
    m = tiny(layout)
    b = batch(B=2)
    full = predict(m, b)
    form = m.stack.recurrent(window=3 * K, chunk=3)  # the whole segment in the window: forward's attention
    states = form.init(2)
    with torch.no_grad():
        for t in range(K):
            sl = slice(t, t + 1)
            x = m.embed(rows(b, lambda v: v[:, sl]))
            h, states = form(x, states)
            torch.testing.assert_close(m.predict_action(h[:, 1]), full[:, t], atol=1e-5, rtol=0)


def test_checkpoint_round_trip(tmp_path):
    """The network comes back from its checkpoint (agents.dt_checkpoint) in eval mode, computing the same."""
    m = tiny("primal+dt")
    info = dt_checkpoint.DataInfo(env="hopper-medium", state_mean=torch.zeros(S_DIM), state_std=torch.ones(S_DIM),
                                  reward_scale=1000.0)
    path = dt_checkpoint.save(dt_checkpoint.DTCheckpoint(m.cfg, m.state_dict(), info), tmp_path / "m.pt")
    m2 = dt_checkpoint.load(path).build_model()
    assert not m2.training and m2.layer_names == m.layer_names
    b = batch()
    torch.testing.assert_close(predict(m2, b), predict(m, b))
    checkpoint.save_atomic({"kind": "classifier", "config": {}, "model": {}}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match="expected 'dt'"):
        dt_checkpoint.load(tmp_path / "c.pt")


@pytest.mark.parametrize("kw, msg", [({"K": 0}, "K must be"), ({"n_heads": 3}, "divisible"),
                                      ({"dropout": 1.0}, "dropout"), ({"name": "nope"}, "unknown")])
def test_bad_model_config_is_rejected(kw, msg):
    base = dict(state_dim=S_DIM, act_dim=A_DIM, d_model=32, n_heads=2)
    with pytest.raises(ValueError, match=msg):
        DecisionTransformer(DTConfig(**{**base, **kw}))
