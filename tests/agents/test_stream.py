"""The streaming engine: equivalence with full-sequence forwards and with recompute over the whole
history, the 3K-1 softmax window, and a state that does not grow with the episode. (The agent's
bookkeeping around it: tests/agents/test_agent.py.)"""

import numpy as np
import pytest
import torch

from agents.stream import StreamEngine, softmax_stream_window, streamed_model_equivalent

CASES = ["primalformer", "primal+dt", "dt", "windowed", "window<chunk", "performer", "cosformer"]
"""names of the layout_cases fixture (tests/agents/conftest.py)"""


def episode(B=2, T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, 11, generator=g), torch.rand(B, T, 3, generator=g) * 2 - 1,
            torch.randn(B, T, 1, generator=g), torch.arange(T).expand(B, T).contiguous())


def test_cases_name_every_layout_case(layout_cases):
    assert CASES == list(layout_cases)


@pytest.mark.parametrize("case", CASES)
def test_stream_equals_forward_over_the_whole_episode(case, layout_cases, tiny_dt):
    layout, opts = layout_cases[case]
    m = tiny_dt(layout, K=4, options=opts)
    S, A, R, T = episode()
    eng = StreamEngine(m, 2)
    out = []
    for t in range(S.shape[1]):
        first = torch.ones(2, dtype=torch.bool) if t == 0 else None
        prev = A[:, t - 1] if t else torch.zeros(2, 3)
        out.append(eng.step(R[:, t, 0], S[:, t], prev, T[:, t], first))
    with torch.no_grad():
        ref, _ = streamed_model_equivalent(m)(S, A, R, T)
    torch.testing.assert_close(torch.stack(out, 1), ref, atol=1e-5, rtol=0)


def test_unwindowed_softmax_streams_with_a_3K_minus_1_window(tiny_dt):
    m = tiny_dt("dt", K=4, options={})
    assert softmax_stream_window(m) == 11
    S, A, R, T = episode(T=30)
    eng = StreamEngine(m, 2)
    out = [eng.step(R[:, t, 0], S[:, t], A[:, t - 1] if t else torch.zeros(2, 3), T[:, t],
                    torch.ones(2, dtype=torch.bool) if t == 0 else None) for t in range(30)]
    with torch.no_grad():
        full, _ = m(S, A, R, T)  # unbounded attention: differs once the episode outgrows the window
    out = torch.stack(out, 1)
    torch.testing.assert_close(out[:, :4], full[:, :4], atol=1e-5, rtol=0)  # 3t+1 < 11: same tokens seen
    assert (out[:, 20:] - full[:, 20:]).abs().max() > 1e-4


def test_state_size_is_constant_in_episode_length(layout_cases, tiny_dt):
    for layout, opts in (layout_cases["primal+dt"], layout_cases["windowed"], layout_cases["performer"]):
        m = tiny_dt(layout, K=4, options=opts)
        eng = StreamEngine(m, 1)

        def numel():  # every tensor an engine's states hold, per-row and shared (nested states too)
            def count(st):
                parts = list(st.rows.values()) + list(st.shared.values())
                return sum(v.numel() if isinstance(v, torch.Tensor) else count(v) if hasattr(v, "rows") else 0
                           for v in parts)
            return sum(count(st) for st in eng.states)

        sizes = []
        for t in range(120):
            eng.step(torch.zeros(1), torch.randn(1, 11), torch.zeros(1, 3), torch.tensor([t]),
                     torch.ones(1, dtype=torch.bool) if t == 0 else None)
            if t in (10, 119):
                sizes.append(numel())
        assert sizes[0] == sizes[1], (layout, sizes)


@pytest.mark.parametrize("case", ["primalformer", "windowed"])
def test_stream_equals_recompute_with_the_full_history(case, layout_cases, tiny_dt, make_agent, rollout_inputs,
                                                      run_agent):
    layout, opts = layout_cases[case]
    m = tiny_dt(layout, K=4, options=opts)
    obs, rew = rollout_inputs()
    a, b = make_agent(m, "stream"), make_agent(m, "recompute", context=obs.shape[0])
    a.reset(3), b.reset(3)
    np.testing.assert_allclose(run_agent(a, obs, rew), run_agent(b, obs, rew), atol=1e-5, rtol=0)
