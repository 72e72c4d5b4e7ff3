"""The classifier honours masks end to end: padding never changes a prediction."""

import pytest
import torch

from primal_dt.classifier import SequenceClassifier, classification_loss
from primal_dt.layouts import layout

OPTS = {"primal": {"s": 4, "data_dependent": True, "rank_multi": 2}}


def make(model, head, kind="continuous", n_inputs=3, max_len=12):
    torch.manual_seed(0)
    m = SequenceClassifier(layout(model, 2, OPTS), input_kind=kind, n_inputs=n_inputs, n_classes=5, max_len=max_len,
                           head=head, d_model=16, n_heads=2, d_ff=32)
    return m.eval()


def batch(kind, B=3, T=9, n_inputs=3):
    lengths = torch.tensor([9, 5, 2])[:B]
    mask = torch.arange(T)[None] < lengths[:, None]
    x = torch.randn(B, T, n_inputs) if kind == "continuous" else torch.randint(1, n_inputs, (B, T))
    return x, mask


def pad_more(x, mask, extra):
    """Append ``extra`` padding positions and fill every padding position with garbage."""
    tokens = x.dim() == mask.dim()
    m2 = torch.cat([mask, torch.zeros(*mask.shape[:-1], extra, dtype=torch.bool)], dim=-1)
    shape = m2.shape if tokens else (*m2.shape, x.shape[-1])
    garbage = torch.randint(1, 5, shape, dtype=x.dtype) if tokens else torch.randn(shape) * 100
    real = torch.zeros(shape, dtype=x.dtype)
    if tokens:
        real[..., : x.shape[-1]] = x
        return torch.where(m2, real, garbage), m2
    real[..., : x.shape[-2], :] = x
    return torch.where(m2.unsqueeze(-1), real, garbage), m2


@pytest.mark.parametrize("model", ["transformer", "primalformer", "primal+trans"])
@pytest.mark.parametrize("head, kind", [("flatten", "continuous"), ("mean", "tokens")])
def test_predictions_invariant_to_extra_right_padding(model, head, kind):
    n_inputs = 3 if kind == "continuous" else 7
    net = make(model, head, kind, n_inputs)
    x, mask = batch(kind, n_inputs=n_inputs)
    ref = net(x, mask).logits
    for extra in (1, 3, 6):  # 9 + 6 = 15 > max_len: cut back, as only padding lies beyond
        x2, m2 = pad_more(x, mask, extra)
        torch.testing.assert_close(net(x2, m2).logits, ref, atol=1e-5, rtol=1e-5)
    # each sequence alone, padded only to its own length, predicts the same
    for i in range(len(x)):
        n = int(mask[i].sum())
        torch.testing.assert_close(net(x[i:i + 1, :n], mask[i:i + 1, :n]).logits, ref[i:i + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", ["transformer", "primalformer"])
def test_pair_head_invariant_to_padding(model):
    net = make(model, "pair", "tokens", 7)
    x = torch.randint(1, 7, (2, 2, 8))
    mask = torch.arange(8)[None, None] < torch.tensor([[8, 3], [5, 1]])[..., None]
    ref = net(x, mask).logits
    x2, m2 = pad_more(x, mask, 4)
    torch.testing.assert_close(net(x2, m2).logits, ref, atol=1e-5, rtol=1e-5)


def test_real_tokens_beyond_max_len_are_an_error():
    net = make("transformer", "flatten", max_len=4)
    x, mask = batch("continuous")
    with pytest.raises(ValueError, match="max_len=4"):
        net(x, mask)


def test_loss_parts_name_primal_layers_by_position():
    net = make("primal+trans", "mean", "tokens", 7).train()
    x, mask = batch("tokens", n_inputs=7)
    loss, parts = classification_loss(net(x, mask), torch.tensor([0, 1, 2]), eta=0.5)
    assert set(k for k in parts if k.startswith("J/")) == {"J/layer1"}
    assert torch.isclose(loss, parts["ce"] + parts["ksvd"])
    loss.backward()
    assert net.stack.blocks[1].attn.Lambda.grad is not None
