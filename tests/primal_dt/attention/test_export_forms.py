"""Export forms (``export_form`` -> base.ExportForm, what agents.export traces into a graph) against the
stream forms they must reproduce, and their contract: pure (no input tensor changes, every state comes
back new), every entry per row and zero at the start, a restarted row is a zeroed row, and a
mechanism without a fixed-size state says why it has none.

Each case streams a sequence in chunks of three tokens as the DT engine does (the first chunk's first
token is padding in some rows), through ``stream_step`` and through the export form, and compares
every real token's output (and with ``last_only`` the chunk's last)."""

from __future__ import annotations

import pytest
import torch

from primal_dt.attention import available, build_attention, get_class
from primal_dt.attention.base import Attention, ExportForm

D, H = 16, 2
B, T, CHUNK = 3, 30, 3
ENGINE_WINDOW = 7  # what a stream engine passes for unbounded caches (the DT's 3K - 1)
OPTIONS = {"primal": {"s": 6}, "cosformer": {"max_len": 64}}
EXTRA = {"primal-w5": ("primal", {"s": 6, "window": 5}), "primal-w2": ("primal", {"s": 6, "window": 2}),
         "primal-w1": ("primal", {"s": 6, "window": 1}), "softmax-w4": ("softmax", {"window": 4}),
         "softmax-w1": ("softmax", {"window": 1}), "primal-nobias": ("primal", {"s": 6, "bias": False})}
GROWING = [n for n in available() if n.startswith(("kernel-", "svr-"))]
"""mechanisms whose recurrent state is a cache of every token: no export form"""


def exportable():
    cases = {n: (n, OPTIONS.get(n, {})) for n in available()
             if get_class(n).supports_step and get_class(n).supports_causal and n not in GROWING}
    return {**cases, **EXTRA}


CASES = exportable()


def make(case):
    name, opts = CASES[case]
    torch.manual_seed(0)
    return build_attention(name, D, H, causal=True, **opts).eval()


def dt_like(seed=0, rows_first=(0, 1)):
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[list(rows_first), 0] = False
    return x, mask


def run_stream(a, x, mask, last_only):
    st, outs = a.init_stream(B, window=ENGINE_WINDOW, chunk=CHUNK), []
    for t in range(0, T, CHUNK):
        m = mask[:, t:t + CHUNK]
        y, st = a.stream_step(x[:, t:t + CHUNK], st, None if bool(m.all()) else m, last_only)
        outs.append(y)
    return torch.cat(outs, 1)


def run_export(form: ExportForm, x, mask, last_only, state=None, t0=0, resets=None):
    """The export form over x[:, t0:] in chunks, always with a mask (as the exported DT step passes
    one); ``resets``: {t: rows} zeroed before the chunk at t, as the exported graph restarts rows."""
    state, outs = state if state is not None else form.init(x.shape[0]), []
    for t in range(t0, x.shape[1], CHUNK):
        if resets and t in resets:
            rows = resets[t]
            state = tuple(torch.where(rows.view(-1, *[1] * (s.dim() - 1)), torch.zeros_like(s), s) for s in state)
        y, state = form(x[:, t:t + CHUNK], state, mask[:, t:t + CHUNK], last_only)
        outs.append(y)
    return torch.cat(outs, 1), state


def test_every_mechanism_with_a_fixed_size_state_has_an_export_form():
    for case in CASES:
        form = make(case).export_form(window=ENGINE_WINDOW)
        assert isinstance(form, ExportForm) and form.specs, case
        assert all(s.shape == tuple(s.shape) and isinstance(s.name, str) for s in form.specs)


@pytest.mark.parametrize("last_only", [False, True], ids=["all-tokens", "last-only"])
@pytest.mark.parametrize("case", list(CASES))
def test_export_form_equals_stream_step(case, last_only):
    a = make(case)
    x, mask = dt_like()
    with torch.no_grad():
        ref = run_stream(a, x, mask, last_only)
        got, _ = run_export(a.export_form(window=ENGINE_WINDOW), x, mask, last_only)
    if last_only:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:  # outputs at padding positions are unspecified in both forms
        torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_export_form_is_pure_and_its_state_is_per_row_with_the_declared_layout(case):
    a = make(case)
    form = a.export_form(window=ENGINE_WINDOW)
    x, mask = dt_like(seed=4)
    with torch.no_grad():
        _, state = run_export(form, x[:, :9], mask[:, :9], False)
        before = [s.clone() for s in state]
        xc, mc = x[:, 9:12].clone(), mask[:, 9:12].clone()
        _, new = form(xc, state, mc, True)
    for s, b in zip(state, before):
        assert torch.equal(s, b), "an export form changed its input state"
    assert torch.equal(xc, x[:, 9:12]) and torch.equal(mc, mask[:, 9:12])
    assert len(new) == len(form.specs)
    for s, spec in zip(new, form.specs):
        assert s.shape == (B, *spec.shape) and s.dtype == spec.dtype, spec
    for s, spec in zip(form.init(2), form.specs):
        assert s.shape == (2, *spec.shape) and s.dtype == spec.dtype and not s.any()


@pytest.mark.parametrize("case", list(CASES))
def test_a_zeroed_row_restarts_like_a_fresh_sequence(case):
    """What the exported graph does on a reset flag: the row's state becomes zero, the others go on."""
    a = make(case)
    form = a.export_form(window=ENGINE_WINDOW)
    x, mask = dt_like(seed=2, rows_first=(0, 1, 2))
    t_reset, rows = 12, torch.tensor([False, True, False])
    m2 = mask.clone()
    m2[1, t_reset] = False  # the restarted row begins like a fresh episode: padding first
    with torch.no_grad():
        got, _ = run_export(form, x, m2, False, resets={t_reset: rows})
        full, _ = run_export(form, x, mask, False)
        fresh, _ = run_export(form, x[1:2, t_reset:], m2[1:2, t_reset:], False)
    keep = ~rows
    torch.testing.assert_close(got[keep][mask[keep]], full[keep][mask[keep]], atol=1e-6, rtol=1e-6)
    real = m2[1, t_reset:]
    torch.testing.assert_close(got[1, t_reset:][real], fresh[0][real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("last_only", [False, True], ids=["all-tokens", "last-only"])
@pytest.mark.parametrize("case", ["softmax", "softmax-w4", "softmax-w1"])
def test_the_softmax_export_ring_takes_any_chunking(case, last_only):
    """The export ring is sized for chunks of three tokens and each row keeps its own phase: shorter chunks
    write it at other phases (rows then sit at different phases in one batch, here after a restart), and
    longer ones go in pieces; every chunking streams what the stream form streams."""
    a = make(case)
    form = a.export_form(window=ENGINE_WINDOW)
    x, mask = dt_like(seed=5)
    sizes = [1, 2, 3, 5, 1, 3, 7, 2, 3, 3]  # T = 30 tokens: the rings (9, 6, 3 slots) wrap at every offset
    restart_at, row = 6, 2  # after chunks of 1, 2, 3 tokens: row 2 starts over at phase 0, the others at 6
    with torch.no_grad():
        st, state, ref, got, t = a.init_stream(B, window=ENGINE_WINDOW, chunk=CHUNK), form.init(B), [], [], 0
        for n in sizes:
            if t == restart_at:
                rows = torch.arange(B) == row
                a.reset_rows(st, rows)
                state = tuple(torch.where(rows.view(-1, *[1] * (s.dim() - 1)), torch.zeros_like(s), s) for s in state)
            xs, ms = x[:, t:t + n], mask[:, t:t + n]
            y, st = a.stream_step(xs, st, ms, last_only)
            ref.append(y)
            y, state = form(xs, state, ms, last_only)
            got.append(y)
            t += n
    if last_only:
        torch.testing.assert_close(torch.cat(got, 1), torch.cat(ref, 1), atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(torch.cat(got, 1)[mask], torch.cat(ref, 1)[mask], atol=1e-5, rtol=1e-5)
    assert state[3].tolist() == [30 % form.slots, 30 % form.slots, (30 - restart_at) % form.slots]


def test_export_form_takes_any_batch():
    a = make("primal-w5")
    form = a.export_form()
    x, mask = dt_like()
    with torch.no_grad():
        both, _ = run_export(form, x[:2], mask[:2], False)
        one, _ = run_export(form, x[1:2], mask[1:2], False)
    torch.testing.assert_close(both[1:2], one, atol=1e-6, rtol=1e-6)


def test_cosformer_rows_past_max_len_get_nan_instead_of_an_error():
    """The stream raises in the chunk that passes max_len; a graph cannot, so that chunk's outputs are
    NaN in the rows that passed it, and so is every later one (until the row restarts)."""
    torch.manual_seed(0)
    a = build_attention("cosformer", D, H, causal=True, max_len=11).eval()
    x, mask = dt_like(rows_first=(0,))  # row 0 starts with padding: one real token fewer
    with torch.no_grad():
        with pytest.raises(ValueError, match="exceeds max_len=11"):
            run_stream(a, x[:, :12], mask[:, :12], False)
        got, _ = run_export(a.export_form(), x[:, :15], mask[:, :15], False)
    assert torch.isfinite(got[:, :9]).all()
    assert torch.isfinite(got[0, 9:12]).all() and torch.isnan(got[1:, 9:]).all()  # rows 1, 2 reach 12 at t=11
    assert torch.isnan(got[0, 12:]).all()


@pytest.mark.parametrize("name", GROWING)
def test_a_cache_of_every_token_has_no_export_form(name):
    a = build_attention(name, D, H, causal=True)
    with pytest.raises(ValueError, match="cache of every token.*grows with the episode"):
        a.export_form(window=ENGINE_WINDOW)


def test_export_form_errors():
    with pytest.raises(ValueError, match="without a window exports over a bounded one"):
        build_attention("softmax", D, H, causal=True).export_form()
    with pytest.raises(ValueError, match="data-dependent Primal-Attention"):
        build_attention("primal", D, H, causal=False, s=4, data_dependent=True).export_form()
    with pytest.raises(ValueError, match="no recurrent form when causal=False"):
        build_attention("performer", D, H, causal=False).export_form()
    with pytest.raises(ValueError, match="no causal recurrent form"):
        Attention.export_form(build_attention("nystrom", D, H, causal=False))
