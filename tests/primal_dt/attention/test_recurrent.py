"""Every registered mechanism's one recurrent form (``Attention.recurrent``), enumerated from the registry:
against the parallel ``forward`` and the naive O(T^2) oracle (naive.py), forward and backward, in any
chunking, with padding, windows, per-row restarts and rows leaving; the state layout it declares; and
its ONNX export (onnxruntime) against its PyTorch run. Adding a mechanism to the registry adds it to every test here."""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from primal_dt.attention import available, build_attention, get_class
from primal_dt.attention.base import Recurrent, restart_rows, select_rows

from .naive import naive

D, H = 16, 2
B, T, CHUNK = 3, 30, 3
ENGINE_WINDOW = 7  # what a stream passes for unbounded caches (the DT's 3K - 1)
OPTIONS = {"primal": {"s": 6}, "cosformer": {"max_len": 64}}
#: windowed variants: windows larger and smaller than a chunk
EXTRA = {"primal-w5": ("primal", {"s": 6, "window": 5}), "primal-w2": ("primal", {"s": 6, "window": 2}),
         "primal-w1": ("primal", {"s": 6, "window": 1}), "softmax-w4": ("softmax", {"window": 4}),
         "softmax-w1": ("softmax", {"window": 1}), "primal-nobias": ("primal", {"s": 6, "bias": False})}


def streamable():
    """Every causal mechanism of the registry that has a recurrent form, plus windowed variants."""
    cases = {n: (n, OPTIONS.get(n, {})) for n in available()
             if get_class(n).supports_step and get_class(n).supports_causal}
    return {**cases, **EXTRA}


CASES = streamable()
FIXED = [c for c in CASES if not CASES[c][0].startswith(("kernel-", "svr-"))]
"""cases with a fixed-size state (the others cache every token)"""


def make(case, dtype=torch.float32):
    name, opts = CASES[case]
    torch.manual_seed(0)
    return build_attention(name, D, H, causal=True, **opts).to(dtype).eval()


def reference(a, x, mask):
    """forward over the whole sequence on a copy that sees what the recurrent form sees (the caller's window)."""
    twin = copy.deepcopy(a)
    twin.adopt_stream_window(ENGINE_WINDOW)
    return twin(x, mask)[0]


def dt_like(seed=0, rows_first=(0, 1)):
    """x [B, T, D] and the mask of a DT stream: the first chunk's first token is padding in some rows."""
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[list(rows_first), 0] = False
    return x, mask


def run(form, x, mask, state=None, t0=0, sizes=None, last_only=False, resets=None):
    """Outputs of ``form`` over x[:, t0:] in chunks (``sizes``, default CHUNK each); ``resets``: {t: rows}
    restarted before the chunk at t. The mask is passed only where a chunk has padding."""
    state = form.init(x.shape[0]) if state is None else state
    sizes = sizes or [CHUNK] * ((x.shape[1] - t0) // CHUNK)
    outs, t = [], t0
    for n in sizes:
        if resets and t in resets:
            state = restart_rows(form.specs, state, resets[t])
        m = mask[:, t:t + n]
        y, state = form(x[:, t:t + n], state, None if bool(m.all()) else m, last_only)
        outs.append(y)
        t += n
    return torch.cat(outs, 1), state


def recurrent(a, **kw):
    return a.recurrent(window=ENGINE_WINDOW, chunk=CHUNK, **kw)


def test_the_registry_enumerates_the_streamable_mechanisms():
    names = {CASES[c][0] for c in CASES}
    assert {"softmax", "primal", "linear", "performer", "cosformer", "kerformer", "flowformer"} <= names
    assert any(n.startswith("kernel-") for n in names) and any(n.startswith("svr-") for n in names)
    for case in CASES:
        form = recurrent(make(case))
        assert isinstance(form, Recurrent) and form.specs, case
        assert form.grows == (case not in FIXED), case


@pytest.mark.parametrize("last_only", [False, True], ids=["all-tokens", "last-only"])
@pytest.mark.parametrize("case", list(CASES))
def test_recurrent_in_chunks_equals_forward(case, last_only):
    a = make(case)
    x, mask = dt_like()
    with torch.no_grad():
        ref = reference(a, x, mask)
        got, _ = run(recurrent(a), x, mask, last_only=last_only)
    if last_only:
        assert got.shape == (B, T // CHUNK, D)
        torch.testing.assert_close(got, ref[:, CHUNK - 1::CHUNK], atol=1e-5, rtol=1e-5)
    else:  # outputs at padding positions are unspecified
        torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_any_chunking_and_padding_equals_forward(case, data):
    """Chunks shorter or longer than the ``chunk`` a ring was sized for, padding anywhere."""
    n = data.draw(st.integers(1, 16), label="T")
    sizes, left = [], n
    while left:
        sizes.append(data.draw(st.integers(1, left), label="chunk"))
        left -= sizes[-1]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000), label="seed"))
    a = make(case)
    x = torch.randn(2, n, D, generator=g)
    mask = torch.rand(2, n, generator=g) > 0.3
    with torch.no_grad():
        ref = reference(a, x, mask)
        got, _ = run(recurrent(a), x, mask, sizes=sizes)
    torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", [c for c in CASES if naive(make(c), torch.zeros(1, 1, D)) is not None])
def test_every_form_equals_the_naive_oracle_forward_and_backward(case):
    """forward and the recurrent form against naive.py, outputs and gradients (inputs; forward's parameters too)."""
    a = make(case, torch.float64)
    x, mask = dt_like()
    x = x.double().requires_grad_()
    ref = naive(a, x, mask, ENGINE_WINDOW)
    g = torch.randn_like(ref) * mask.unsqueeze(-1)
    (dx_ref, *dp_ref) = torch.autograd.grad((ref * g).sum(), [x, *a.parameters()], allow_unused=True)
    y = reference(a, x, mask)
    torch.testing.assert_close(y[mask], ref[mask], atol=1e-9, rtol=1e-7)
    twin = copy.deepcopy(a)
    twin.adopt_stream_window(ENGINE_WINDOW)
    dx, *dp = torch.autograd.grad((twin(x, mask)[0] * g).sum(), [x, *twin.parameters()], allow_unused=True)
    torch.testing.assert_close(dx, dx_ref, atol=1e-9, rtol=1e-7)
    for (name, _), p, q in zip(a.named_parameters(), dp, dp_ref):
        if q is None:
            assert p is None or not p.any(), name
        else:
            torch.testing.assert_close(p, q, atol=1e-9, rtol=1e-7, msg=name)
    got, _ = run(recurrent(a), x, mask)
    torch.testing.assert_close(got[mask], ref[mask], atol=1e-9, rtol=1e-7)
    (dx_rec,) = torch.autograd.grad((got * g).sum(), [x])
    torch.testing.assert_close(dx_rec, dx_ref, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("case", list(CASES))
def test_a_restarted_row_is_a_fresh_sequence_and_the_others_go_on(case):
    a = make(case)
    form = recurrent(a)
    x, mask = dt_like(seed=2, rows_first=(0, 1, 2))
    t_reset, rows = 12, torch.tensor([False, True, False])
    m2 = mask.clone()
    m2[1, t_reset] = False  # the restarted row begins like a fresh episode: padding first
    with torch.no_grad():
        got, _ = run(form, x, m2, resets={t_reset: rows})
        full = reference(a, x, mask)
        fresh = reference(a, x[1:2, t_reset:], m2[1:2, t_reset:])
    keep = ~rows
    torch.testing.assert_close(got[keep][mask[keep]], full[keep][mask[keep]], atol=1e-5, rtol=1e-5)
    real = m2[1, t_reset:]
    torch.testing.assert_close(got[1, t_reset:][real], fresh[0][real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_rows_that_leave_do_not_change_the_others(case):
    a = make(case)
    form = recurrent(a)
    x, mask = dt_like(seed=3)
    t_drop, keep = 9, torch.tensor([True, False, True])
    with torch.no_grad():
        _, state = run(form, x[:, :t_drop], mask[:, :t_drop])
        got, _ = run(form, x[keep], mask[keep], state=select_rows(state, keep), t0=t_drop)
        ref = reference(a, x, mask)
    torch.testing.assert_close(got, ref[keep, t_drop:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_the_form_is_pure_and_its_state_has_the_declared_layout(case):
    form = recurrent(make(case))
    x, mask = dt_like(seed=4)
    with torch.no_grad():
        _, state = run(form, x[:, :9], mask[:, :9])
        before = [s.clone() for s in state]
        xc, mc = x[:, 9:12].clone(), mask[:, 9:12].clone()
        _, new = form(xc, state, mc, True)
    for s, b in zip(state, before):
        assert torch.equal(s, b), "the recurrent form changed its input state"
    assert torch.equal(xc, x[:, 9:12]) and torch.equal(mc, mask[:, 9:12])
    assert len(new) == len(form.specs)
    for s, spec in zip(new, form.specs):
        grown = tuple(s.shape[1:]) if 0 in spec.shape else spec.shape
        assert s.shape == (B, *grown) and s.dtype == spec.dtype, spec
    for s, spec in zip(form.init(2), form.specs):
        assert s.shape == (2, *spec.shape) and s.dtype == spec.dtype and not s.any()


@pytest.mark.parametrize("last_only", [False, True], ids=["all-tokens", "last-only"])
@pytest.mark.parametrize("case", ["softmax", "softmax-w4", "softmax-w1"])
def test_softmax_rows_at_different_ring_phases_mix_in_one_batch(case, last_only):
    """Each row keeps its own ring phase: shorter chunks write the ring at other phases, a restarted row
    starts over at phase 0 while the others go on, and longer chunks go in pieces."""
    a = make(case)
    form = recurrent(a)
    x, mask = dt_like(seed=5)
    sizes = [1, 2, 3, 5, 1, 3, 7, 2, 3, 3]  # T = 30 tokens: the rings (9, 6, 3 slots) wrap at every offset
    rows = torch.arange(B) == 2
    with torch.no_grad():
        got, state = run(form, x, mask, sizes=sizes, resets={6: rows}, last_only=last_only)
        full = reference(a, x, mask)
        fresh = reference(a, x[2:, 6:], mask[2:, 6:])
    ends = np.cumsum(sizes) - 1
    if last_only:
        real = mask[:2, ends]  # (the first chunk's token is padding in rows 0 and 1)
        torch.testing.assert_close(got[:2][real], full[:2, ends][real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[2, 3:], fresh[0, ends[3:] - 6], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got[:2][mask[:2]], full[:2][mask[:2]], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[2, 6:], fresh[0], atol=1e-5, rtol=1e-5)
    assert state[3].tolist() == [30 % form.slots, 30 % form.slots, (30 - 6) % form.slots]


def test_cosformer_rows_past_max_len_get_nan():
    """The parallel form raises past max_len; the recurrent form, which a graph traces and a graph cannot
    raise, marks that chunk's outputs NaN in the rows that passed it, and every later one."""
    torch.manual_seed(0)
    a = build_attention("cosformer", D, H, causal=True, max_len=11).eval()
    x, mask = dt_like(rows_first=(0,))  # row 0 starts with padding: one real token fewer
    with torch.no_grad():
        with pytest.raises(ValueError, match="exceeds max_len=11"):
            a(x[:, :12], mask[:, :12])
        got, _ = run(a.recurrent(), x[:, :15], mask[:, :15])
    assert torch.isfinite(got[:, :9]).all()
    assert torch.isfinite(got[0, 9:12]).all() and torch.isnan(got[1:, 9:]).all()  # rows 1, 2 reach 12 at t=11
    assert torch.isnan(got[0, 12:]).all()


@pytest.mark.parametrize("case", FIXED)
def test_the_onnx_export_runs_what_torch_runs(case):
    """The form traced to ONNX (as agents.export traces it, batch axis dynamic) and run by onnxruntime
    gives the PyTorch outputs and states, chunk after chunk, at another batch than traced."""
    import onnxruntime as ort

    a = make(case)
    form = recurrent(a)
    x, mask = dt_like(seed=7)
    names = [s.name.replace(".", "_") for s in form.specs]
    inputs, outputs = ["x", "mask", *names], ["y", *("next_" + n for n in names)]

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.form = form  # (a submodule: its weights are the graph's initializers)

        def forward(self, x, mask, *state):
            y, new = self.form(x, state, mask, False)
            return (y, *new)

    buf = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes
        torch.onnx.export(Step(), (x[:2, :CHUNK], mask[:2, :CHUNK], *form.init(2)), buf, dynamo=False,
                          input_names=inputs, output_names=outputs, opset_version=17,
                          dynamic_axes={n: {0: "batch"} for n in inputs + outputs})
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    fed = {i.name for i in sess.get_inputs()}
    state, ort_state = form.init(B), [s.numpy() for s in form.init(B)]
    for t in range(0, T, CHUNK):
        xs, ms = x[:, t:t + CHUNK], mask[:, t:t + CHUNK]
        with torch.no_grad():
            y, state = form(xs, state, ms, False)
        feed = dict(zip(inputs, [xs.numpy(), ms.numpy(), *ort_state]))
        y_ort, *ort_state = sess.run(None, {k: v for k, v in feed.items() if k in fed})
        np.testing.assert_allclose(y_ort[ms.numpy()], y[ms].numpy(), atol=1e-5, rtol=1e-5)
        for s, o, spec in zip(state, ort_state, form.specs):
            np.testing.assert_allclose(o, s.numpy(), atol=1e-5, rtol=1e-5, err_msg=spec.name)


def test_recurrent_form_errors():
    with pytest.raises(ValueError, match="without a window streams over a bounded one"):
        build_attention("softmax", D, H, causal=True).recurrent()
    with pytest.raises(ValueError, match="data-dependent Primal-Attention has no causal form to stream"):
        build_attention("primal", D, H, causal=False, s=4, data_dependent=True).recurrent()
    for name in ("primal", "performer", "softmax"):
        with pytest.raises(ValueError, match="no recurrent form when causal=False"):
            build_attention(name, D, H, causal=False, **OPTIONS.get(name, {})).recurrent(window=4)
    for name in [n for n in available() if not (get_class(n).supports_step and get_class(n).supports_causal)]:
        a = build_attention(name, D, H, causal=not get_class(name).supports_bidirectional, **OPTIONS.get(name, {}))
        with pytest.raises(ValueError, match="recurrent"):
            a.recurrent(window=4)
