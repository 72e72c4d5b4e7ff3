"""The streaming engine: equivalence with full-sequence forwards and with recompute over the whole
history, the 3K-1 softmax window, and a state that does not grow with the episode. (The agent's
bookkeeping around it: tests/agents/test_agent.py.)"""

import numpy as np
import pytest
import torch

from agents.decision_transformer import Batch, DTStep, softmax_stream_window, streamed_model_equivalent
from agents import Agent, DataInfo

CASES = ["primalformer", "primal+dt", "dt", "windowed", "window<chunk", "performer", "cosformer"]
"""names of the layout_cases fixture (tests/agents/conftest.py)"""


def episode(B=2, T=40, seed=0):
    """observations [B, T, 11], rewards [B, T] and the targets [B] of an episode, and the scaled
    returns-to-go [B, T, 1] and timesteps [B, T] the step must derive from them (reward_scale 10)."""
    g = torch.Generator().manual_seed(seed)
    S, rew, target = torch.randn(B, T, 11, generator=g), torch.rand(B, T, generator=g), torch.full((B,), 50.0)
    R = (target[:, None] - torch.cumsum(rew, 1) + rew) / 10  # R_t = (target - rewards before t) / scale
    return S, rew, target, R.unsqueeze(-1), torch.arange(T).expand(B, T).contiguous()


def engine(m, B):
    ag = Agent(m, DataInfo("hopper-medium", np.zeros(11), np.ones(11), reward_scale=10.0, targets=(50.0,)))
    ag.reset(B)
    return ag


def run(ag, S, rew):
    return torch.stack([torch.from_numpy(ag.act(S[:, t].numpy(), rew[:, t - 1].numpy() if t else None))
                        for t in range(S.shape[1])], 1)


def test_cases_name_every_layout_case(layout_cases):
    assert CASES == list(layout_cases)


@pytest.mark.parametrize("case", CASES)
def test_stream_equals_forward_over_the_whole_episode(case, layout_cases, tiny_dt):
    """The step's own bookkeeping (return-to-go from target and rewards, timesteps, its previous action)
    and every layer's recurrent form give what the streamed-equivalent model's forward gives."""
    layout, opts = layout_cases[case]
    m = tiny_dt(layout, K=4, options=opts)
    S, rew, target, R, T = episode()
    out = run(engine(m, 2), S, rew)
    with torch.no_grad():
        ref, _ = streamed_model_equivalent(m)(Batch(S, out, R, T))  # a_t is never seen by the prediction at t
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_only_an_inplace_step_writes_the_state_it_is_given(tiny_dt):
    """The step a graph traces is pure (the state passed in stays as it was); the agent's (``inplace``) writes its
    softmax rings where they lie, and acts the same."""
    m = tiny_dt("dt", K=4, options={})
    pure, inplace = (DTStep(m, np.zeros(11), np.ones(11), 10.0, inplace=i) for i in (False, True))
    S, rew, target, _, _ = episode(T=15)
    sp, si, wrote = pure.init(2).flat(), inplace.init(2).flat(), False
    with torch.no_grad():
        for t in range(15):
            r, before_p, before_i = rew[:, t - 1] if t else torch.zeros(2), [s.clone() for s in sp], si[3].clone()
            ap, *new = pure(S[:, t], r, None, target, *sp)
            assert all(torch.equal(a, b) for a, b in zip(before_p, sp)) and new[3] is not sp[3]
            ai, *si_new = inplace(S[:, t], r, None, target, *si)
            wrote |= si_new[3] is si[3] and not torch.equal(si[3], before_i)  # layer 0's keys, written where they lay
            torch.testing.assert_close(ai, ap, atol=0, rtol=0)
            sp, si = new, si_new
    assert wrote


def test_unwindowed_softmax_streams_with_a_3K_minus_1_window(tiny_dt):
    m = tiny_dt("dt", K=4, options={})
    assert softmax_stream_window(m) == 11
    S, rew, target, R, T = episode(T=30)
    out = run(engine(m, 2), S, rew)
    with torch.no_grad():
        full, _ = m(Batch(S, out, R, T))  # unbounded attention: differs once the episode outgrows the window
    torch.testing.assert_close(out[:, :4], full[:, :4], atol=1e-5, rtol=0)  # 3t+1 < 11: same tokens seen
    assert (out[:, 20:] - full[:, 20:]).abs().max() > 1e-4


def test_state_size_is_constant_in_episode_length(layout_cases, tiny_dt):
    for layout, opts in (layout_cases["primal+dt"], layout_cases["windowed"], layout_cases["performer"]):
        m = tiny_dt(layout, K=4, options=opts)
        eng = engine(m, 1)
        sizes = []
        for t in range(120):
            eng.act(np.random.randn(1, 11), np.zeros(1))
            if t in (10, 119):
                sizes.append(sum(s.numel() for s in eng.state.flat()))
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
