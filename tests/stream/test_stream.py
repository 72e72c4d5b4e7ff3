"""The streaming engine and the agent: equivalence with full-sequence forwards and with recompute,
per-row restarts, return-to-go / timestep bookkeeping, bounded state, and clear errors."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from agents import Agent, load_agent
from agents.stream import StreamEngine, softmax_stream_window, streamed_model_equivalent
from primal_dt.attention import build_attention

_spec = importlib.util.spec_from_file_location("stream_helpers", Path(__file__).with_name("helpers.py"))
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)

CASES = {
    "primalformer": ("primalformer-dt", {"primal": {"s": 8}}),
    "primal+dt": ("primal+dt", {"primal": {"s": 8}}),
    "dt": ("dt", {}),
    "windowed": ("primal+dt", {"primal": {"s": 8, "window": 10}, "softmax": {"window": 7}}),
    "window<chunk": ("primalformer-dt", {"primal": {"s": 8, "window": 2}}),
    "performer": ("performer", {}),
    "cosformer": ("cosformer", {}),
}


def episode(B=2, T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, 11, generator=g), torch.rand(B, T, 3, generator=g) * 2 - 1,
            torch.randn(B, T, 1, generator=g), torch.arange(T).expand(B, T).contiguous())


@pytest.mark.parametrize("case", list(CASES))
def test_stream_equals_forward_over_the_whole_episode(case):
    layout, opts = CASES[case]
    m = h.tiny_model(layout, K=4, options=opts)
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


def test_unwindowed_softmax_streams_with_a_3K_minus_1_window():
    m = h.tiny_model("dt", K=4, options={})
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


def test_state_size_is_constant_in_episode_length():
    for layout, opts in (CASES["primal+dt"], CASES["windowed"], CASES["performer"]):
        m = h.tiny_model(layout, K=4, options=opts)
        eng = StreamEngine(m, 1)

        def numel():
            total = 0
            for k in eng.kernels:
                for v in vars(k).values():
                    if isinstance(v, torch.Tensor) and v is not getattr(k, "M", None):
                        total += v.numel()
                    if isinstance(v, dict):
                        total += sum(x.numel() for x in v.values() if isinstance(x, torch.Tensor))
            return total

        sizes = []
        for t in range(120):
            eng.step(torch.zeros(1), torch.randn(1, 11), torch.zeros(1, 3), torch.tensor([t]),
                     torch.ones(1, dtype=torch.bool) if t == 0 else None)
            if t in (10, 119):
                sizes.append(numel())
        assert sizes[0] == sizes[1], (layout, sizes)


def rollout_inputs(T=25, B=3, seed=1):
    g = np.random.default_rng(seed)
    return g.normal(size=(T, B, 11)).astype(np.float32), g.uniform(0, 3, size=(T, B)).astype(np.float32)


def run_agent(agent, obs, rew, resets=None):
    """act on obs[t] with the previous reward; resets: {t: done mask applied before step t}."""
    acts, reward = [], None
    for t in range(obs.shape[0]):
        if resets and t in resets:
            agent.reset_done(resets[t])
        acts.append(agent.act(obs[t], reward))
        reward = rew[t]
    return np.stack(acts)


def make_agent(m, engine, **kw):
    mean, std = h.hopper_stats()
    return Agent(m, state_mean=mean, state_std=std, reward_scale=1000.0, target=3600.0, engine=engine, **kw)


@pytest.mark.parametrize("case", ["primalformer", "windowed"])
def test_stream_equals_recompute_with_the_full_history(case):
    layout, opts = CASES[case]
    m = h.tiny_model(layout, K=4, options=opts)
    obs, rew = rollout_inputs()
    a, b = make_agent(m, "stream"), make_agent(m, "recompute", context=obs.shape[0])
    a.reset(3), b.reset(3)
    np.testing.assert_allclose(run_agent(a, obs, rew), run_agent(b, obs, rew), atol=1e-5, rtol=0)


def test_recompute_with_context_K_matches_a_forward_on_the_last_K_steps():
    m = h.tiny_model("primal+dt", K=4)
    obs, rew = rollout_inputs(T=12, B=1)
    ag = make_agent(m, "recompute")
    ag.reset(1)
    acts = run_agent(ag, obs, rew)
    mean, std = h.hopper_stats()
    S = torch.as_tensor((obs[:, 0] - mean) / std)[None]
    rtg = torch.as_tensor(3.6 - np.concatenate([[0], np.cumsum(rew[:-1, 0])]) / 1000.0, dtype=torch.float32)
    A = torch.as_tensor(acts[:, 0])[None]
    t = 9
    with torch.no_grad():
        w = slice(t - 3, t + 1)  # the last K = 4 steps
        pred, _ = m(S[:, w], A[:, w], rtg[None, w, None], torch.arange(t - 3, t + 1)[None])
    np.testing.assert_allclose(acts[t, 0], pred[0, -1].numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("engine", ["stream", "recompute"])
def test_reset_done_restarts_one_row_like_a_fresh_agent(engine):
    m = h.tiny_model("primal+dt", K=4)
    obs, rew = rollout_inputs(T=20, B=3)
    t_reset = 8
    done = np.array([False, True, False])
    ag = make_agent(m, engine)
    ag.reset(3)
    acts = run_agent(ag, obs, rew, {t_reset: done})
    plain = make_agent(m, engine)
    plain.reset(3)
    ref = run_agent(plain, obs, rew)
    np.testing.assert_allclose(acts[:, [0, 2]], ref[:, [0, 2]], atol=1e-6, rtol=0)  # other rows untouched
    fresh = make_agent(m, engine)
    fresh.reset(1)
    ref1 = run_agent(fresh, obs[t_reset:, 1:2], rew[t_reset:, 1:2])
    np.testing.assert_allclose(acts[t_reset:, 1], ref1[:, 0], atol=1e-5, rtol=0)
    assert not np.allclose(acts[t_reset:, 1], ref[t_reset:, 1], atol=1e-4)  # it really restarted


@pytest.mark.parametrize("engine,case", [("stream", "primal+dt"), ("stream", "windowed"), ("stream", "performer"),
                                         ("recompute", "primal+dt")])
def test_keep_rows_continues_the_kept_episodes_unchanged(engine, case):
    """Dropping finished rows mid-episode (the evaluator's tail) leaves the others' actions as if
    the batch had never shrunk, for every kind of per-layer state (sums, rings, KV cache, generic)."""
    layout, opts = CASES[case]
    m = h.tiny_model(layout, K=4, options=opts)
    obs, rew = rollout_inputs(T=20, B=4)
    t_drop, keep = 7, np.array([True, False, True, False])
    ref = make_agent(m, engine)
    ref.reset(4)
    full = run_agent(ref, obs, rew)
    ag = make_agent(m, engine)
    ag.reset(4)
    head = run_agent(ag, obs[:t_drop], rew[:t_drop])
    ag.keep_rows(keep)
    assert ag.batch == 2 and ag.timesteps.tolist() == [t_drop, t_drop]
    tail, reward = [], rew[t_drop - 1][keep]
    for t in range(t_drop, 20):
        tail.append(ag.act(obs[t][keep], reward))
        reward = rew[t][keep]
    np.testing.assert_allclose(head, full[:t_drop], atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.stack(tail), full[t_drop:][:, keep], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="keep must have shape"):
        ag.keep_rows(np.ones(4, bool))
    with pytest.raises(ValueError, match="drop every row"):
        ag.keep_rows(np.zeros(2, bool))


def test_return_to_go_and_timestep_bookkeeping():
    m = h.tiny_model()
    ag = make_agent(m, "stream")
    ag.reset(2, target=[3600.0, 1800.0])
    np.testing.assert_allclose(ag.returns_to_go, [3600.0, 1800.0], atol=1e-3)
    o = np.zeros((2, 11), np.float32)
    ag.act(o)  # t = 0: no reward yet
    assert ag.timesteps.tolist() == [1, 1]
    ag.act(o, np.array([10.0, 20.0]))
    np.testing.assert_allclose(ag.returns_to_go, [3590.0, 1780.0], atol=1e-3)
    ag.act(o, np.array([5.0, 5.0]))
    np.testing.assert_allclose(ag.returns_to_go, [3585.0, 1775.0], atol=1e-3)
    assert ag.timesteps.tolist() == [3, 3]
    ag.reset_done(np.array([True, False]), target=1000.0)
    assert ag.timesteps.tolist() == [0, 3]
    ag.act(o, np.array([7.0, 7.0]))  # row 0 is at t = 0: the reward that ended its episode is ignored
    np.testing.assert_allclose(ag.returns_to_go, [1000.0, 1768.0], atol=1e-3)
    assert ag.timesteps.tolist() == [1, 4]


def test_load_agent_reads_the_checkpoint_bookkeeping(tmp_path):
    m = h.tiny_model()
    p = h.save_checkpoint(tmp_path, m, targets=(3000.0, 1500.0), reward_scale=500.0)
    ag = load_agent(p, engine="stream")
    ag.reset(1)
    np.testing.assert_allclose(ag.returns_to_go, [3000.0], atol=1e-3)
    assert ag.reward_scale == 500.0
    np.testing.assert_allclose(ag.mean.numpy(), h.hopper_stats()[0])
    ag.act(np.zeros((1, 11), np.float32))
    ag.act(np.zeros((1, 11), np.float32), np.array([100.0]))
    np.testing.assert_allclose(ag.returns_to_go, [2900.0], atol=1e-3)


def test_clear_errors(tmp_path):
    m = h.tiny_model()
    ag = make_agent(m, "stream")
    with pytest.raises(RuntimeError, match="reset"):
        ag.act(np.zeros((1, 11)))
    ag.reset(2)
    with pytest.raises(ValueError, match=r"obs must have shape \[batch=2, state_dim=11\]"):
        ag.act(np.zeros((3, 11)))
    with pytest.raises(ValueError, match="obs must have shape"):
        ag.act(np.zeros((2, 17)))
    with pytest.raises(ValueError, match="reward must have shape"):
        ag.act(np.zeros((2, 11)), np.zeros(5))
    with pytest.raises(ValueError, match="done must have shape"):
        ag.reset_done(np.zeros(3, bool))
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        make_agent(m, "fast")
    with pytest.raises(ValueError, match="unknown engine"):
        load_agent(h.save_checkpoint(tmp_path, m), engine="fast")
    wrong = h.save_checkpoint(tmp_path / "cls", m, kind="classifier")
    with pytest.raises(ValueError, match="holds a 'classifier' model, expected 'dt'"):
        load_agent(wrong)
    bi = h.tiny_model()
    bi.stack.blocks[0].attn = build_attention("softmax", 32, 2, causal=False)
    with pytest.raises(ValueError, match="causal recurrent form"):
        make_agent(bi, "stream")
    with pytest.raises(ValueError, match="bidirectional"):
        make_agent(bi, "recompute")
    ck = h.checkpoint_dict(m)
    ck["model_config"]["layers"] = ["softmax", "nystrom", "primal"]
    with pytest.raises(ValueError, match="causal"):
        load_agent(ck)
