"""The agent: per-row restarts, dropping finished rows, return-to-go / timestep bookkeeping, loading a
checkpoint's bookkeeping, and clear errors. Checked on both engines where the agent, not the engine,
owns the behaviour."""

import numpy as np
import pytest

from agents import Agent, load_agent
from agents.dt_checkpoint import DataInfo
from primal_dt.attention import build_attention


@pytest.mark.parametrize("engine", ["stream", "recompute"])
def test_reset_done_restarts_one_row_like_a_fresh_agent(engine, tiny_dt, make_agent, rollout_inputs, run_agent):
    m = tiny_dt("primal+dt", K=4)
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
def test_keep_rows_continues_the_kept_episodes_unchanged(engine, case, layout_cases, tiny_dt, make_agent,
                                                         rollout_inputs, run_agent):
    """Dropping finished rows mid-episode (the evaluator's tail) leaves the others' actions as if
    the batch had never shrunk, for every kind of per-layer state (sums, rings, KV cache, generic)."""
    layout, opts = layout_cases[case]
    m = tiny_dt(layout, K=4, options=opts)
    obs, rew = rollout_inputs(T=20, B=4)
    t_drop, keep = 7, np.array([True, False, True, False])
    ref = make_agent(m, engine)
    ref.reset(4)
    full = run_agent(ref, obs, rew)
    ag = make_agent(m, engine)
    ag.reset(4)
    head = run_agent(ag, obs[:t_drop], rew[:t_drop])
    ag.keep_rows(keep)
    assert ag.batch == 2
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


def returns_to_go(agent) -> list[float]:
    """R_t of each row's last step in raw returns (the step state holds it divided by reward_scale)."""
    return (agent.state.rtg.double() * agent.reward_scale).tolist()


def test_return_to_go_and_timestep_bookkeeping(tiny_dt, make_agent):
    m = tiny_dt()
    ag = make_agent(m, "stream")
    ag.reset(2, target=[3600.0, 1800.0])
    o = np.zeros((2, 11), np.float32)
    ag.act(o)  # t = 0: no reward yet, R_0 is the target
    np.testing.assert_allclose(returns_to_go(ag), [3600.0, 1800.0], atol=1e-3)
    assert ag.state.t.tolist() == [1, 1]
    ag.act(o, np.array([10.0, 20.0]))
    np.testing.assert_allclose(returns_to_go(ag), [3590.0, 1780.0], atol=1e-3)
    ag.act(o, np.array([5.0, 5.0]))
    np.testing.assert_allclose(returns_to_go(ag), [3585.0, 1775.0], atol=1e-3)
    assert ag.state.t.tolist() == [3, 3]
    ag.reset_done(np.array([True, False]), target=1000.0)
    assert ag.state.t.tolist() == [0, 3]
    ag.act(o, np.array([7.0, 7.0]))  # row 0 is at t = 0: the reward that ended its episode is ignored
    np.testing.assert_allclose(returns_to_go(ag), [1000.0, 1768.0], atol=1e-3)
    assert ag.state.t.tolist() == [1, 4]


def test_load_agent_reads_the_checkpoint_bookkeeping(tmp_path, tiny_dt, hopper_stats, dt_checkpoint_file):
    m = tiny_dt()
    p = dt_checkpoint_file(tmp_path, m, targets=(3000.0, 1500.0), reward_scale=500.0)
    ag = load_agent(p, engine="stream", runtime="torch")
    ag.reset(1)
    assert ag.reward_scale == 500.0
    np.testing.assert_allclose(ag.mean.numpy(), hopper_stats[0])
    ag.act(np.zeros((1, 11), np.float32))
    np.testing.assert_allclose(returns_to_go(ag), [3000.0], atol=1e-3)
    ag.act(np.zeros((1, 11), np.float32), np.array([100.0]))
    np.testing.assert_allclose(returns_to_go(ag), [2900.0], atol=1e-3)
    assert isinstance(ag.info, DataInfo) and ag.info.env == "hopper-medium" and ag.info.targets == (3000.0, 1500.0)
    same = load_agent(tmp_path, engine="recompute")  # the run directory means its last.pt
    same.reset(1)
    same.act(np.zeros((1, 11), np.float32))
    np.testing.assert_allclose(returns_to_go(same), [3000.0], atol=1e-3)


def test_load_agent_without_targets_aims_at_the_environments_first(tmp_path, tiny_dt, dt_checkpoint_file):
    """A checkpoint that recorded no targets: the default comes from envs' table for its env, not
    from a number in the agent (walker2d: 5000, hopper: 3600)."""
    import envs

    m = tiny_dt()
    for env in ("hopper-medium", "walker2d-medium"):
        ag = load_agent(dt_checkpoint_file(tmp_path / env, m, targets=(), env=env), runtime="torch")
        ag.reset(1)
        ag.act(np.zeros((1, 11), np.float32))
        np.testing.assert_allclose(returns_to_go(ag), [envs.get_spec(env).targets[0]], atol=1e-3)
        assert ag.info.eval_targets == envs.get_spec(env).targets


def test_agent_needs_the_bookkeeping_it_cannot_guess(tiny_dt, hopper_info):
    """The statistics, scale and targets come with the run's DataInfo, never from a default here."""
    with pytest.raises(TypeError, match="info"):
        Agent(tiny_dt())
    ag = Agent(tiny_dt(), hopper_info)
    ag.reset(1)
    ag.act(np.zeros((1, 11), np.float32))
    np.testing.assert_allclose(returns_to_go(ag), [3600.0], atol=1e-3)


def test_clear_errors(tmp_path, tiny_dt, make_agent, dt_checkpoint, dt_checkpoint_file, foreign_checkpoint_file):
    """Construction and loading; wrong calls (shapes, targets, order) are checked for every runtime at
    once in tests/agents/test_onnx_policy.py."""
    m = tiny_dt()
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        make_agent(m, "fast")
    with pytest.raises(ValueError, match="unknown engine"):
        load_agent(dt_checkpoint_file(tmp_path, m), engine="fast", runtime="torch")
    for runtime in ("torch", "onnx"):  # named before anything is read or another option is judged by it
        with pytest.raises(ValueError, match="unknown engine 'fast'; choose one of recompute, stream"):
            load_agent(tmp_path / "no-such-run", engine="fast", runtime=runtime)
    wrong = foreign_checkpoint_file(tmp_path / "cls")
    with pytest.raises(ValueError, match="holds a 'classifier' model, expected 'dt'"):
        load_agent(wrong, runtime="torch")
    bi = tiny_dt()
    bi.stack.blocks[0].attn = build_attention("softmax", 32, 2, causal=False)
    with pytest.raises(ValueError, match="causal recurrent form"):
        make_agent(bi, "stream")
    with pytest.raises(ValueError, match="bidirectional"):
        make_agent(bi, "recompute")
    ck = dt_checkpoint(m).to_dict()
    ck["model_config"]["layers"] = "softmax,nystrom,primal"
    with pytest.raises(ValueError, match="causal"):
        load_agent(ck, runtime="torch")
    ck["model_config"]["layers"] = ["softmax", "nystrom", "primal"]  # not what to_dict writes: named, not a crash
    with pytest.raises(ValueError, match=r"model_config.layers must be a string, got \["):
        load_agent(ck, runtime="torch")


def test_load_agent_refuses_a_crafted_checkpoint_without_running_it(tmp_path, crafted_checkpoint):
    marker = tmp_path / "pwned"
    path = crafted_checkpoint(tmp_path / "run" / "last.pt", marker)
    for where in (path, path.parent):
        with pytest.raises(ValueError, match=f"checkpoint {path} was not loaded: .*could run code"):
            load_agent(where, runtime="torch")
    assert not marker.exists()


def test_load_agent_checks_the_data_it_is_given(tmp_path, tiny_dt, dt_checkpoint, write_hopper_file):
    """data=: the dataset the checkpoint was trained on passes (read from a source, where its run read
    it, or given loaded); other data is refused naming both sources."""
    from agents import dt_checkpoint as schema
    from envs import load_dataset

    mine, other = write_hopper_file(tmp_path / "mine-v2.hdf5"), write_hopper_file(tmp_path / "other-v2.hdf5", seed=1)
    data = load_dataset("hopper-medium", source=f"d4rl:{mine}", verbose=False)
    ck = dt_checkpoint(tiny_dt(), source=data.source)
    ck.data.fingerprint, ck.config["data_source"] = data.fingerprint, f"d4rl:{mine}"
    path = schema.save(ck, tmp_path / "run" / "last.pt")
    for ok in (True, f"d4rl:{mine}", data):
        assert load_agent(path, data=ok, runtime="torch").info.fingerprint == data.fingerprint
    for bad in (f"d4rl:{other}", load_dataset("hopper-medium", source=f"d4rl:{other}", verbose=False)):
        with pytest.raises(ValueError, match=f"checkpoint {path} was trained on d4rl:{mine} .*fingerprint "
                                             f"{data.fingerprint[:19]}.*but the data read now from d4rl:{other} differs"):
            load_agent(path, data=bad, runtime="torch")
