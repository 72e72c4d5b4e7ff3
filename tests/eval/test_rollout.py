"""The vectorised rollout evaluator on real Hopper simulators (sync and subprocess vector envs) with
real checkpoints: per-episode seeding, engine/num_envs independence, the report, the trainer hook."""

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

import envs
from agents import DataInfo, load_agent
from agents.agent import Agent
from eval import rollout
from eval.video import record_episode, rendering_available
from agents.train_config import RolloutOptions

SPEC = envs.get_spec("hopper-medium")
MAX = 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_dt, dt_checkpoint_file):
    return dt_checkpoint_file(tmp_path_factory.mktemp("ck"), tiny_dt("primal+dt", K=5))


def run(ckpt, episodes=3, seed=5, details=None, **kw):
    options = RolloutOptions(**{"targets": (3600.0, 1800.0), "num_envs": 4, "max_steps": MAX, "engine": "stream", **kw})
    return rollout.evaluate(str(ckpt), episodes, seed, options, details=details)


def sequential(ckpt, target, episodes, seed, engine="stream", max_steps=MAX):
    """The reference protocol: one episode at a time, batch-1 agent, env reset with seed + e."""
    agent = load_agent(ckpt, engine=engine, target=target, runtime="torch")
    env = envs.make_env("hopper-medium", None)
    out = []
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        agent.reset(1)
        total, reward = 0.0, None
        for _ in range(max_steps):
            obs, r, term, trunc, _ = env.step(agent.act(obs[None], reward)[0])
            total += r
            reward = np.array([r])
            if term or trunc:
                break
        out.append(total)
    env.close()
    return out


def test_sync_and_async_agree_and_match_the_sequential_protocol(ckpt):
    d_sync, d_one, d_asyn = {}, {}, {}
    sync = run(ckpt, details=d_sync)  # two lanes of 2 simulators, each lane in its own process
    one = run(ckpt, lanes=1, details=d_one)
    asyn = run(ckpt, asynchronous=True, details=d_asyn)
    assert (d_sync["lanes"], d_one["lanes"], d_asyn["lanes"]) == (2, 1, 1)
    for t in (3600.0, 1800.0):
        assert len(sync[t]["returns"]) == 3
        np.testing.assert_allclose(one[t]["returns"], asyn[t]["returns"], rtol=0, atol=1e-9)  # same batches
        np.testing.assert_allclose(sync[t]["returns"], asyn[t]["returns"], rtol=1e-6)
        assert sync[t]["lengths"] == asyn[t]["lengths"] == one[t]["lengths"]
        np.testing.assert_allclose(sync[t]["returns"], sequential(ckpt, t, 3, 5), rtol=1e-4)
        assert all(1 <= n <= MAX for n in sync[t]["lengths"])
        np.testing.assert_allclose(sync[t]["normalized"], envs.normalized_score("hopper-medium", sync[t]["returns"]))
        assert sync[t]["normalized_mean"] == pytest.approx(np.mean(sync[t]["normalized"]))
        assert sync[t]["return_std"] == pytest.approx(np.std(sync[t]["returns"]))
    # episodes differ by seed, and the same seed gives the same episode whatever the row
    assert len(set(np.round(sync[3600.0]["returns"], 6))) == 3


def test_results_do_not_depend_on_num_envs_and_recompute_runs_too(ckpt):
    a = run(ckpt, num_envs=2, episodes=4)
    b = run(ckpt, num_envs=7, episodes=4)
    np.testing.assert_allclose(a[3600.0]["returns"], b[3600.0]["returns"], rtol=1e-4)
    details = {}
    rec = run(ckpt, num_envs=3, engine="recompute", details=details)
    np.testing.assert_allclose(rec[1800.0]["returns"], sequential(ckpt, 1800.0, 3, 5, "recompute"), rtol=1e-4)
    assert details["engine"] == "recompute" and details["lanes"] == 2 and details["latency"]["batch"] == 2  # 3 = 2 + 1
    assert details["env_steps"] == sum(sum(r["lengths"]) for r in rec.values())


def test_a_checkpoint_brings_its_bookkeeping_a_bare_model_needs_it_given(tmp_path, tiny_dt, hopper_stats,
                                                                          dt_checkpoint_file):
    """evaluate(checkpoint) divides returns-to-go by the checkpoint's reward_scale (not a default)
    and normalises with its statistics; evaluating a bare model without them is a clear error."""
    m = tiny_dt("primal+dt", K=5)
    path = dt_checkpoint_file(tmp_path, m, reward_scale=500.0)
    mean, std = hopper_stats
    options = RolloutOptions(targets=(3600.0,), num_envs=2, max_steps=15, lanes=1)
    from_ck = rollout.evaluate(path, 2, 5, options)
    given = rollout.evaluate(m, 2, 5, options, data=DataInfo("hopper-medium", mean, std, reward_scale=500.0))
    papers = rollout.evaluate(m, 2, 5, options, data=DataInfo("hopper-medium", mean, std, reward_scale=1000.0))
    assert from_ck == given
    assert papers[3600.0]["returns"] != given[3600.0]["returns"]  # the scale reaches the model
    with pytest.raises(ValueError, match="data .* is required when evaluating a model; a checkpoint carries it"):
        rollout.evaluate(m, 1, 0, options)


def test_finished_rows_leave_the_batch_and_idle_simulators_are_not_stepped(ckpt):
    """With more simulators than episodes left, rows whose episode ended leave the agent's batch
    and their simulators are no longer stepped; results equal the one-at-a-time protocol."""
    agent = load_agent(ckpt, engine="stream", target=3600.0, runtime="torch")
    venv = rollout.vector_env("hopper-medium", 4, False, None)
    stepped = [0] * 4
    for i, e in enumerate(venv.envs):
        def counted(a, _step=e.step, i=i):
            stepped[i] += 1
            return _step(a)
        e.step = counted
    try:
        res = rollout.run_episodes(agent, venv, [(3600.0, e) for e in range(3)], seed=5, max_steps=400)
    finally:
        venv.close()
    lengths = res["lengths"]
    assert len(set(lengths)) > 1, "the test needs episodes of different lengths (the hopper falls)"
    np.testing.assert_allclose(res["returns"], sequential(ckpt, 3600.0, 3, 5, max_steps=400), rtol=1e-4)
    assert stepped[:3] == lengths and stepped[3] == 0  # the 4th simulator had no job
    assert res["act_rows"][0] == 3 and min(res["act_rows"]) >= 1
    assert sum(res["act_rows"]) == res["env_steps"] == sum(lengths)
    assert res["act_rows"][-1] == sum(n == max(lengths) for n in lengths)  # the batch shrank
    assert res["act_rows"][min(lengths)] == 3 - sum(n == min(lengths) for n in lengths)


@pytest.mark.slow
def test_the_episode_loop_drives_any_runtime_of_the_acting_api(ckpt, tmp_path):
    """The evaluators' loop takes any policy with the shared API: the exported ONNX runtime plays the
    torch agent's episodes (its actions agree to 1e-5), restarts and departing rows included."""
    from agents.export import export_policy
    from agents.onnx_policy import OnnxPolicy

    jobs = [(3600.0, e) for e in range(3)] + [(1800.0, 0)]
    out = {}
    for name, policy in (("agent", load_agent(ckpt, engine="stream", runtime="torch")),
                         ("onnx", OnnxPolicy(export_policy(ckpt, "onnx", tmp_path / "policy.onnx")))):
        venv = rollout.vector_env("hopper-medium", 3)
        try:
            out[name] = rollout.run_episodes(policy, venv, jobs, seed=5, max_steps=MAX)
        finally:
            venv.close()
    assert out["onnx"]["lengths"] == out["agent"]["lengths"] and out["onnx"]["act_rows"] == out["agent"]["act_rows"]
    assert min(out["agent"]["act_rows"]) < 3, "rows left the batch"
    np.testing.assert_allclose(out["onnx"]["returns"], out["agent"]["returns"], rtol=1e-4)


def test_simulator_process_steps_like_the_vector_env_and_reports_failures():
    """A lane's simulators in a subprocess give what the same SyncVectorEnv gives in-process; a
    simulator that cannot be built is the same clear error as in-process, and close() leaves no
    process."""
    from eval.episodes import step_rows
    from eval.simulators import SimulatorProcess

    proc = SimulatorProcess("hopper-medium", 3)
    local = rollout.vector_env("hopper-medium", 3, False, None)
    try:
        a, _ = proc.reset(seed=[1, 2, 3])
        b, _ = local.reset(seed=[1, 2, 3])
        np.testing.assert_array_equal(a, b)
        rows, act = np.array([0, 2]), np.full((2, 3), 0.3, np.float32)
        proc.step_rows_async(rows, act)
        for x, y in zip(proc.step_rows_wait(), step_rows(local, rows, act)):
            np.testing.assert_array_equal(x, y)
    finally:
        proc.close()
        local.close()
    assert not proc._proc.is_alive()
    with pytest.raises(ValueError, match="hopper-medium is evaluated in Hopper, not NoSuchEnv-v9"):
        SimulatorProcess("hopper-medium", 2, gym_id="NoSuchEnv-v9")


def test_cli_writes_a_json_report(ckpt, tmp_path):
    out = tmp_path / "report.json"
    rollout.main([f"checkpoint={ckpt.parent}", "episodes=2", "num_envs=2", f"max_steps={MAX}", "targets=3600",
                  f"out={out}", "progress=false"])
    rep = json.loads(out.read_text())
    assert rep["engine"] == "recompute" and rep["env"] == "hopper-medium" and rep["episodes_per_target"] == 2  # default
    t = rep["targets"]["3600"]
    assert len(t["returns"]) == 2 and {"normalized_mean", "normalized_std", "return_std", "length_mean"} <= set(t)
    assert rep["lanes"] == 2 and rep["agent_latency"]["batch"] == 1 and rep["agent_latency"]["mean_ms"] > 0


def test_a_report_that_cannot_be_written_whole_leaves_no_file(tmp_path, tiny_dt, dt_checkpoint_file, run_cli):
    """Under a file-size limit smaller than the report (as a full disk), the rollout is one error line
    naming the report, and neither a truncated report nor its claimed empty name is left in the run."""
    ck = dt_checkpoint_file(tmp_path / "run", tiny_dt("primal+dt", K=5))
    p = run_cli("eval.rollout", f"checkpoint={ck}", "episodes=1", "num_envs=1", "max_steps=3", "targets=3600",
                "progress=false", file_size=1024)
    assert p.returncode == 1 and "could not write the rollout report" in p.stderr, p.stderr[-2000:]
    assert not list(ck.parent.glob("rollout-*")) and not list(ck.parent.glob(".rollout-*"))


def test_cli_clear_errors(ckpt, tmp_path, foreign_checkpoint_file, capsys):
    wrong = foreign_checkpoint_file(tmp_path)
    with pytest.raises(SystemExit, match="holds a 'classifier' model, expected 'dt'"):
        rollout.main([f"checkpoint={wrong}", "progress=false"])
    with pytest.raises(SystemExit, match="does not exist"):
        rollout.main([f"checkpoint={tmp_path / 'nope.pt'}", "progress=false"])
    for bad, says in (("engine=fast", "'fast'"), ("targets=3600,high", "--targets")):  # tyro's errors
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            rollout.main([f"checkpoint={ckpt}", bad, "progress=false"])
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_video_unavailable_backend_gives_a_clear_message(ckpt, tmp_path, tiny_dt, hopper_stats):
    ok, msg = rendering_available("no-such-backend")
    assert not ok
    assert "MUJOCO_GL=no-such-backend" in msg and "rollout results are unaffected" in msg
    model = tiny_dt("primal+dt", K=5)
    info = DataInfo(env="hopper-medium", state_mean=hopper_stats[0], state_std=hopper_stats[1], reward_scale=1000.0)
    res = record_episode(model, SPEC, info, 3600.0, "stream", 0, tmp_path, backend="no-such-backend")
    assert res["path"] is None and res["message"] == msg
    assert not list(tmp_path.glob("*.gif"))


@pytest.mark.slow
def test_video_is_recorded_when_rendering_works(tmp_path, tiny_dt, hopper_stats):
    ok, backend = rendering_available()
    if not ok:
        pytest.skip(backend)
    model = tiny_dt("primal+dt", K=5)
    info = DataInfo(env="hopper-medium", state_mean=hopper_stats[0], state_std=hopper_stats[1], reward_scale=1000.0)
    res = record_episode(model, SPEC, info, 3600.0, "stream", 0, tmp_path, max_steps=20, size=64)
    assert Path(res["path"]).exists() and res["frames"] >= 2


# -- a hostile user ------------------------------------------------------------------------------------
def test_cli_refuses_a_crafted_checkpoint_and_its_payload_never_runs(tmp_path, crafted_checkpoint, run_cli,
                                                                      one_line_error):
    marker = tmp_path / "pwned"
    path = crafted_checkpoint(tmp_path / "evil.pt", marker)
    p = run_cli("eval.rollout", f"checkpoint={path}", "episodes=1", "progress=false")
    one_line_error(p, f"checkpoint {path} was not loaded", "could run code")
    assert not marker.exists() and not list(tmp_path.glob("rollout-*.json"))


@pytest.mark.parametrize("bad, message", [
    ("targets=nan", "targets must hold numbers that are in [-1000000000000, 1000000000000], got nan"),
    ("eval.targets=3600,inf", "targets must hold numbers that are in [-1000000000000, 1000000000000], got 3600.0, inf"),
    ("max_steps=-5", "max_steps must be >= 0, got -5"),
    ("episodes=0", "episodes must be >= 1, got 0"),
    ("num_envs=-1", "num_envs must be >= 1, got -1"),
    ("seed=-3", r"seed must be in [0, 4294967296), got -3"),
    ("lanes=-1", "lanes must be >= 0, got -1"),
    ("device=gpu", "device must be auto, cpu, cuda or cuda:N"),
    ("precision=bf16", "precision"),  # gone: the stream runs in float32 only, tyro names the unknown option
    (f"out={__file__}/x.json", f"out={__file__}/x.json: {__file__} is a file; give the report's file path"),
    (f"out={Path(__file__).parent}", "is a directory; give the report's file path"),
])
def test_cli_checks_every_option_before_reading_the_checkpoint(tmp_path, bad, message, capsys):
    """The checkpoint does not even exist: the option is refused first, before any simulation."""
    with pytest.raises(SystemExit) as exit_:
        rollout.main([f"checkpoint={tmp_path / 'absent.pt'}", bad, "progress=false"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_every_numeric_option_is_valid_or_named(fuzz_options, tmp_path):
    from primal_dt.run.cli import parse

    def validate(argv):
        rollout.check(parse(rollout.RolloutConfig, argv))

    fuzz_options(validate, {"episodes": "int", "num_envs": "int", "lanes": "int", "seed": "int", "max_steps": "int",
                            "threads": "int", "targets": "floats"}, base=[f"checkpoint={tmp_path / 'x.pt'}"],
                 examples=80)


def test_reports_are_never_overwritten(ckpt, tmp_path):
    """A second rollout of the same checkpoint and engine writes rollout-stream-2.json; an explicit out=
    that exists is refused unless overwrite=true."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "last.pt").write_bytes(ckpt.read_bytes())
    common = [f"checkpoint={run_dir}", "episodes=1", "num_envs=1", "max_steps=5", "targets=3600", "engine=stream",
              "progress=false"]
    rollout.main(common)
    first = (run_dir / "rollout-stream.json").read_text()
    rollout.main(common + ["max_steps=3"])
    assert (run_dir / "rollout-stream.json").read_text() == first
    assert json.loads((run_dir / "rollout-stream-2.json").read_text())["max_steps"] == 3
    with pytest.raises(SystemExit, match=r"out=.*rollout-stream.json exists .* overwrite=true"):
        rollout.main(common + [f"out={run_dir / 'rollout-stream.json'}"])
    rollout.main(common + [f"out={run_dir / 'rollout-stream.json'}", "overwrite=true", "max_steps=2"])
    assert json.loads((run_dir / "rollout-stream.json").read_text())["max_steps"] == 2
    assert sorted(p.name for p in run_dir.iterdir()) == ["last.pt", "rollout-stream-2.json", "rollout-stream.json"]


def test_data_source_checks_the_checkpoint_against_its_dataset(tmp_path, tiny_dt, dt_checkpoint, write_hopper_file):
    """check_data=true reads the training data first (where the run read it, or data_source=...): the
    data the checkpoint was trained on passes, a dataset with other content is refused naming both
    sources, before any simulation."""
    from agents import dt_checkpoint as schema
    from envs import load_dataset

    mine, other = write_hopper_file(tmp_path / "mine-v2.hdf5"), write_hopper_file(tmp_path / "other-v2.hdf5", seed=1)
    data = load_dataset("hopper-medium", source=f"d4rl:{mine}", verbose=False)
    ck = dt_checkpoint(tiny_dt("primal+dt", K=5), source=data.source)
    ck.data.fingerprint, ck.config["data_source"] = data.fingerprint, f"d4rl:{mine}"
    path = schema.save(ck, tmp_path / "run" / "last.pt")
    common = [f"checkpoint={path}", "episodes=1", "num_envs=1", "max_steps=3", "progress=false"]
    rep = rollout.main(common + ["check_data=true"])
    assert rep["data_fingerprint"] == data.fingerprint and rep["data_source"] == f"d4rl:{mine}"
    with pytest.raises(SystemExit, match=f"was trained on d4rl:{mine} .*but the data read now from d4rl:{other} "
                                         "differs"):
        rollout.main(common + [f"data_source=d4rl:{other}"])


class _RefusingAgent(Agent):
    """An agent that raises at its fourth act, wherever it runs (pickled into a lane process, it goes along)."""

    calls = 0

    def act(self, obs, reward=None):
        self.calls += 1
        if self.calls > 3:
            raise KeyError("the test agent refuses its fourth step")
        return super().act(obs, reward)


def test_an_agents_exception_in_a_lane_process_reaches_the_caller_as_raised(ckpt):
    """The lane's exception itself (its type and message), its traceback in the lane attached as the cause."""
    from agents import dt_checkpoint
    from eval.episodes import run_episodes
    from eval.simulators import LaneTraceback, SimulatorProcess

    ck = dt_checkpoint.load(ckpt)
    model = ck.build_model()
    agents = [_RefusingAgent(model, ck.data, engine="stream") for _ in range(2)]
    with contextlib.ExitStack() as stack:
        lanes = [stack.enter_context(contextlib.closing(SimulatorProcess("hopper-medium", 2, threads=1)))
                 for _ in agents]
        with pytest.raises(KeyError, match="refuses its fourth step") as caught:
            run_episodes(agents, lanes, [(3600.0, e) for e in range(4)], seed=0, max_steps=MAX)
    cause = caught.value.__cause__
    assert isinstance(cause, LaneTraceback) and "in act" in str(cause) and "raise KeyError" in str(cause)
