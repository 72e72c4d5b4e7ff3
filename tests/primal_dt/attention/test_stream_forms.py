"""Stream forms (``init_stream`` / ``stream_step``) against the parallel form, and declared per-row state.

For every mechanism with a recurrent form (fast stream forms: primal's fused sums and ring, softmax's
ring KV cache; the others: their recurrent ``step``): streaming a sequence in chunks of three tokens, as
the DT engine does (the first chunk's first token is padding in some rows), reproduces ``forward`` over
the whole sequence at every real token, with ``last_only`` both ways, chunks longer than the buffers,
and windows smaller than a chunk. ``reset_rows`` / ``select_rows`` on stream states leave the other
rows' outputs unchanged, and entries declared shared survive them even when their first dimension
equals the batch (shape-guessing used to zero or slice them).
"""

from __future__ import annotations

import copy

import pytest
import torch

from primal_dt.attention import available, build_attention, get_class
from primal_dt.attention.base import Attention
from primal_dt.attention.state import State
from primal_dt.blocks import Block, LayerSpec

D, H = 16, 2
B, T, CHUNK = 3, 30, 3
ENGINE_WINDOW = 7  # what a stream engine passes for unbounded caches (the DT's 3K - 1)
OPTIONS = {"primal": {"s": 6}}
#: windowed variants: fused ring with window >= chunk, and windows smaller than a chunk
EXTRA = {"primal-w5": ("primal", {"s": 6, "window": 5}), "primal-w3": ("primal", {"s": 6, "window": 3}),
         "primal-w2": ("primal", {"s": 6, "window": 2}), "primal-w1": ("primal", {"s": 6, "window": 1}),
         "softmax-w4": ("softmax", {"window": 4}), "softmax-w1": ("softmax", {"window": 1})}


def streamable():
    cases = {n: (n, OPTIONS.get(n, {})) for n in available()
             if get_class(n).supports_step and get_class(n).supports_causal}
    return {**cases, **EXTRA}


CASES = streamable()


def make(case, dtype=torch.float32):
    name, opts = CASES[case]
    torch.manual_seed(0)
    return build_attention(name, D, H, causal=True, **opts).to(dtype).eval()


def reference(a, x, mask):
    """forward over the whole sequence on a copy that sees what the stream sees (the engine's window)."""
    twin = copy.deepcopy(a)
    twin.adopt_stream_window(ENGINE_WINDOW)
    with torch.no_grad():
        return twin(x, mask)[0]


def dt_like(seed=0, rows_first=(0, 1)):
    """x [B, T, D] and the mask of a DT stream: the first chunk's first token is padding in some rows."""
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[list(rows_first), 0] = False
    return x, mask


def stream(a, x, mask, state, t0=0, size=CHUNK, last_only=False):
    """Outputs of stream_step over x[:, t0:] in chunks of ``size``; the mask is passed only where a
    chunk has padding (the engine passes None otherwise)."""
    outs = []
    for t in range(t0, x.shape[1], size):
        m = mask[:, t:t + size]
        y, state = a.stream_step(x[:, t:t + size], state, None if bool(m.all()) else m, last_only)
        outs.append(y)
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("last_only", [False, True], ids=["all-tokens", "last-only"])
@pytest.mark.parametrize("case", list(CASES))
def test_stream_in_chunks_equals_forward(case, last_only):
    a = make(case)
    x, mask = dt_like()
    ref = reference(a, x, mask)
    with torch.no_grad():
        got, _ = stream(a, x, mask, a.init_stream(B, window=ENGINE_WINDOW, chunk=CHUNK), last_only=last_only)
    if last_only:
        assert got.shape == (B, T // CHUNK, D)
        torch.testing.assert_close(got, ref[:, CHUNK - 1::CHUNK], atol=1e-5, rtol=1e-5)
    else:  # outputs at padding positions are unspecified in stream forms
        torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["primal", "primal-w5", "primal-w2", "softmax", "softmax-w4", "performer"])
@pytest.mark.parametrize("size", [1, 5, 7])
def test_any_chunk_length_streams_exactly(case, size):
    """Chunks shorter or longer than the ``chunk`` the buffers were sized for (longer ones go in pieces)."""
    a = make(case)
    x, mask = dt_like(seed=1)
    ref = reference(a, x, mask)
    with torch.no_grad():
        got, _ = stream(a, x, mask, a.init_stream(B, window=ENGINE_WINDOW, chunk=CHUNK), size=size)
    torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_reset_rows_restarts_one_row_and_leaves_the_others(case):
    a = make(case)
    x, mask = dt_like(seed=2, rows_first=(0, 1, 2))
    t_reset = 12
    with torch.no_grad():
        _, st = stream(a, x[:, :t_reset], mask[:, :t_reset], a.init_stream(B, window=ENGINE_WINDOW, chunk=CHUNK))
        Attention.reset_rows(st, torch.tensor([False, True, False]))
        m2 = mask.clone()
        m2[1, t_reset] = False  # the restarted row begins like a fresh episode: padding first
        got, _ = stream(a, x, m2, st, t0=t_reset)
    full = reference(a, x, mask)
    fresh = reference(a, x[1:2, t_reset:], m2[1:2, t_reset:])
    keep = torch.tensor([True, False, True])
    torch.testing.assert_close(got[keep], full[keep, t_reset:], atol=1e-5, rtol=1e-5)
    real = m2[1:2, t_reset:]
    torch.testing.assert_close(got[1:2][real], fresh[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_select_rows_continues_the_kept_rows_unchanged(case):
    a = make(case)
    x, mask = dt_like(seed=3)
    t_drop, keep = 9, torch.tensor([True, False, True])
    with torch.no_grad():
        _, st = stream(a, x[:, :t_drop], mask[:, :t_drop], a.init_stream(B, window=ENGINE_WINDOW, chunk=CHUNK))
        st = Attention.select_rows(st, keep)
        got, _ = stream(a, x[keep], mask[keep], st, t0=t_drop)
    ref = reference(a, x, mask)
    torch.testing.assert_close(got, ref[keep, t_drop:], atol=1e-5, rtol=1e-5)


# -- declared per-row state ------------------------------------------------------------------------

def test_shared_entries_with_batch_rows_survive_reset_and_select():
    """A shared table whose first dimension equals the batch is not a per-row entry."""
    batch = 4
    table = torch.arange(batch * 5, dtype=torch.float32).view(batch, 5)  # e.g. one row per ring phase
    st = State(rows={"sum": torch.ones(batch, 3), "sub": State(rows={"flags": torch.ones(batch, 2, dtype=torch.bool)})},
               shared={"table": table.clone(), "pos": 7})
    st.reset_rows(torch.tensor([True, False, True, False]))
    assert torch.equal(st["table"], table) and st["pos"] == 7
    assert st["sum"][:, 0].tolist() == [0, 1, 0, 1]
    assert st["sub"]["flags"][:, 0].tolist() == [False, True, False, True]
    small = st.select_rows(torch.tensor([False, True, True, True]))
    assert torch.equal(small["table"], table) and small["pos"] == 7
    assert small["sum"].shape == (3, 3) and small["sub"]["flags"].shape == (3, 2)
    small.shared["pos"] = 8  # the smaller state's clock is its own
    assert st["pos"] == 7


def test_fused_primal_weights_survive_when_batch_equals_width():
    """The fused [D, 2D] output matrix of a primal stream is shared: with batch == D, guessing per-row
    entries from shapes would have zeroed (reset) or sliced (select) its rows."""
    a = make("primal")
    x = torch.randn(D, 6, D)
    with torch.no_grad():
        st = a.init_stream(D)
        M = st["M"].clone()
        _, st = a.stream_step(x[:, :3], st)
        Attention.reset_rows(st, torch.arange(D) % 2 == 0)
        assert torch.equal(st["M"], M)
        keep = torch.arange(D) < D - 1
        small = Attention.select_rows(st, keep)
        assert torch.equal(small["M"], M) and small["sum"].shape == (D - 1, 2 * D)
        y, _ = a.stream_step(x[keep, 3:], small)
        ref, _ = a(x)
    odd = (torch.arange(D) % 2 == 1)[keep]
    torch.testing.assert_close(y[odd], ref[keep][odd, 3:], atol=1e-5, rtol=1e-5)


def test_state_misuse_is_a_clear_error():
    with pytest.raises(ValueError, match="per-row entry 'pos' must be a batch-first tensor"):
        State(rows={"pos": 3})
    with pytest.raises(ValueError, match=r"per-row entry 'x' must be a batch-first tensor.*0-d tensor"):
        State(rows={"x": torch.tensor(1.0)})
    with pytest.raises(ValueError, match=r"\['k'\] declared both per-row and shared"):
        State(rows={"k": torch.zeros(2, 1)}, shared={"k": 0})
    st = State(rows={"k": torch.zeros(2, 1)})
    with pytest.raises(ValueError, match="entry 'k' has 2 rows but the selection has 3"):
        st.reset_rows(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"expected a \[batch\] bool tensor"):
        st.select_rows(torch.tensor([0, 1]))
    with pytest.raises(KeyError, match=r"no entry 'q'.*per-row: \['k'\]"):
        st["q"]
    with pytest.raises(ValueError, match="expected the State returned by init_state"):
        Attention.reset_rows({"k": torch.zeros(2, 1)}, torch.ones(2, dtype=torch.bool))


def test_stream_errors():
    with pytest.raises(ValueError, match="without a window streams over a bounded one"):
        make("softmax").init_stream(1)
    dd = build_attention("primal", D, H, causal=False, s=4, data_dependent=True)
    with pytest.raises(ValueError, match="data-dependent Primal-Attention has no causal form to stream"):
        dd.init_stream(1)
    with pytest.raises(ValueError, match="no recurrent form when causal=False"):
        build_attention("softmax", D, H, causal=False).init_stream(1, window=4)
    post = Block(D, H, LayerSpec("primal", {"s": 4}), causal=True, norm="post")
    with pytest.raises(ValueError, match=r"pre-norm.*post-norm"):
        post.init_stream(1)


def test_every_recurrent_state_declares_its_rows():
    """init_state and init_stream return State for every mechanism with a recurrent form."""
    for case in CASES:
        a = make(case)
        for st in (a.init_state(2), a.init_stream(2, window=ENGINE_WINDOW, chunk=CHUNK)):
            assert isinstance(st, State), case
