"""precision.py and the bf16 stream forms: bfloat16 weight matmuls against a float64 formula, states
that stay in the model's dtype, clear errors for layers without a bf16 form, and a bf16 stream that
tracks the exact one over a long sequence (its error does not build up)."""

import pytest
import torch
import torch.nn.functional as F

from primal_dt.attention.precision import PRECISIONS, check_precision, linear, weight
from primal_dt.blocks import Stack


def test_linear_is_plain_f_linear_when_dtypes_agree():
    x, w, b = torch.randn(5, 3, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_bf16_linear_rounds_input_and_weight_then_adds_the_bias_in_the_input_dtype():
    x, w, b = torch.randn(7, 64), torch.randn(32, 64), torch.randn(32) * 100
    y = linear(x, w.bfloat16(), b)
    assert y.dtype == torch.float32
    # the formula: products of bf16-rounded values, summed exactly, then rounded once to bf16 (the matmul's
    # output dtype), then the float32 bias
    exact = x.bfloat16().double() @ w.bfloat16().double().T
    torch.testing.assert_close(y.double(), exact.bfloat16().double() + b.double(), atol=1e-5, rtol=0)
    # ... so the bias keeps float32 precision: a bf16 bias would be off by up to 0.25 at magnitude 100
    assert (y.double() - exact - b.double()).abs().max() <= exact.abs().max() * 2 ** -8 + 1e-5


def test_weight_snapshots():
    p = torch.nn.Parameter(torch.randn(4, 4))
    same = weight(p, "fp32")
    assert same.data_ptr() == p.data_ptr() and not same.requires_grad  # the parameter itself: updates show
    half = weight(p, "bf16")
    assert half.dtype == torch.bfloat16 and torch.equal(half, p.detach().bfloat16())
    assert weight(None, "bf16") is None


def test_unknown_precision_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"precision must be one of fp32, bf16, got 'fp16'"):
        check_precision("fp16")
    assert set(PRECISIONS) == {"fp32", "bf16"}


def stack(layers, d=32, heads=2, seed=0):
    from primal_dt.blocks import LayerSpec

    torch.manual_seed(seed)
    specs = [LayerSpec("primal", {"s": 8}) if x == "primal" else x for x in layers]
    return Stack(d, heads, specs, causal=True, dropout=0.0, activation="relu").eval()


def test_bf16_snapshots_the_matmul_weights_and_keeps_accumulating_states_in_the_model_dtype():
    s = stack(["softmax", "primal"])
    fp32 = s.recurrent(window=8, chunk=3)
    assert all(w.dtype == torch.float32 for mlp in fp32.mlps for w in mlp)
    form = s.recurrent(window=8, chunk=3, precision="bf16")
    soft, primal = form.forms
    k, v, valid, pos = soft.specs
    assert k.dtype == v.dtype == torch.bfloat16  # a cache: values rounded once, never summed
    assert soft.wqkv.dtype == soft.wp.dtype == torch.bfloat16 and soft.bqkv.dtype == torch.float32
    assert primal.specs[0].dtype == torch.float32  # running sums: float32 (a bf16 sum would stop moving)
    assert primal.wqk.dtype == torch.bfloat16 and primal.bqk.dtype == torch.float32
    for (w1, b1, w2, b2), block in zip(form.mlps, s.blocks):
        assert w1.dtype == w2.dtype == torch.bfloat16 and b2.dtype == torch.float32
        assert torch.equal(w1, block.mlp[0].weight.detach().bfloat16())


def test_a_layer_without_a_bf16_form_is_named():
    s = stack(["softmax", "performer"])
    with pytest.raises(ValueError, match=r"layer 1 \(performer\): PerformerAttention streams in fp32 only"):
        s.recurrent(window=8, chunk=3, precision="bf16")
    with pytest.raises(ValueError, match="precision must be one of"):
        s.recurrent(window=8, chunk=3, precision="half")


@pytest.mark.parametrize("layers", [["softmax", "softmax", "primal"], ["primal", "primal"],
                                    [{"attention": "primal", "options": {"window": 5, "s": 8}}, "softmax"]],
                         ids=["primal+dt", "primalformer", "windowed"])
def test_bf16_stream_tracks_the_exact_stream_over_a_long_sequence(layers):
    """600 chunks of 3 tokens: the bf16 outputs stay within a few bf16 roundings of the exact ones at
    the end as at the start (nothing accumulates in bf16), and the primal running sums agree to float32
    precision relative to bf16 rounding."""
    from primal_dt.blocks import LayerSpec

    specs = [LayerSpec(x["attention"], x["options"]) if isinstance(x, dict) else x for x in layers]
    s = stack(specs, d=64, heads=4)
    exact, half = (s.recurrent(window=11, chunk=3, precision=p) for p in ("fp32", "bf16"))
    st32, st16 = exact.init(3), half.init(3)
    g = torch.Generator().manual_seed(1)
    errors = []
    with torch.inference_mode():
        for t in range(600):
            x = torch.randn(3, 3, 64, generator=g)
            y32, st32 = exact(x, st32, last_only=True)
            y16, st16 = half(x, st16, last_only=True)
            assert y16.dtype == torch.float32
            errors.append(float((y32 - y16).abs().max()))
    first, last = max(errors[:50]), max(errors[-50:])
    assert 0 < first < 0.1 and last < 0.1
    assert last < 3 * first + 0.02  # no drift over the sequence
    for spec, a32, a16 in zip(exact.specs, st32, st16):
        if spec.name.endswith(".sum"):  # an unwindowed primal layer: 1800 tokens summed
            rel = (a32 - a16).norm() / a32.norm()
            assert rel < 1e-2, rel
