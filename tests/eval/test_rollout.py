"""The vectorised rollout evaluator on real Hopper simulators (sync and subprocess vector envs) with
real checkpoints: per-episode seeding, engine/num_envs independence, the report, the trainer hook."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import envs
from agents import load_agent
from eval import rollout
from eval.video import record_episode, rendering_available

_spec = importlib.util.spec_from_file_location(
    "stream_helpers", Path(__file__).parents[1] / "stream" / "helpers.py")
h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(h)

SPEC = envs.get_spec("hopper-medium")
MAX = 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return h.save_checkpoint(tmp_path_factory.mktemp("ck"), h.tiny_model("primal+dt", K=5))


def run(ckpt, **kw):
    args = dict(episodes=3, seed=5, num_envs=4, max_steps=MAX)
    args.update(kw)
    return rollout.evaluate(str(ckpt), SPEC, (3600.0, 1800.0), args.pop("episodes"), args.pop("seed"), **args)


def sequential(ckpt, target, episodes, seed, engine="stream"):
    """The reference protocol: one episode at a time, batch-1 agent, env reset with seed + e."""
    agent = load_agent(ckpt, engine=engine, target=target)
    env = envs.make_env("hopper-medium", None)
    out = []
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        agent.reset(1)
        total, reward = 0.0, None
        for _ in range(MAX):
            obs, r, term, trunc, _ = env.step(agent.act(obs[None], reward)[0])
            total += r
            reward = np.array([r])
            if term or trunc:
                break
        out.append(total)
    env.close()
    return out


def test_sync_and_async_agree_and_match_the_sequential_protocol(ckpt):
    sync = run(ckpt)
    asyn = run(ckpt, asynchronous=True)
    for t in (3600.0, 1800.0):
        assert len(sync[t]["returns"]) == 3
        np.testing.assert_allclose(sync[t]["returns"], asyn[t]["returns"], rtol=0, atol=1e-9)
        assert sync[t]["lengths"] == asyn[t]["lengths"]
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
    assert details["engine"] == "recompute" and details["latency"]["batch"] == 3
    assert details["env_steps"] == sum(sum(r["lengths"]) for r in rec.values())


def test_cli_writes_a_json_report(ckpt, tmp_path):
    out = tmp_path / "report.json"
    rollout.main([f"checkpoint={ckpt.parent}", "episodes=2", "num_envs=2", f"max_steps={MAX}", "targets=3600",
                  f"out={out}", "progress=false"])
    rep = json.loads(out.read_text())
    assert rep["engine"] == "stream" and rep["env"] == "hopper-medium" and rep["episodes_per_target"] == 2
    t = rep["targets"]["3600"]
    assert len(t["returns"]) == 2 and {"normalized_mean", "normalized_std", "return_std", "length_mean"} <= set(t)
    assert rep["agent_latency"]["batch"] == 2 and rep["agent_latency"]["mean_ms"] > 0


def test_cli_clear_errors(ckpt, tmp_path):
    wrong = h.save_checkpoint(tmp_path, h.tiny_model(), kind="classifier")
    with pytest.raises(SystemExit, match="holds a 'classifier' model, expected 'dt'"):
        rollout.main([f"checkpoint={wrong}", "progress=false"])
    with pytest.raises(SystemExit, match="does not exist"):
        rollout.main([f"checkpoint={tmp_path / 'nope.pt'}", "progress=false"])
    with pytest.raises(SystemExit, match="unknown engine 'fast'"):
        rollout.main([f"checkpoint={ckpt}", "engine=fast", "progress=false"])
    with pytest.raises(SystemExit, match="targets="):
        rollout.main([f"checkpoint={ckpt}", "targets=high", "progress=false"])


def test_video_unavailable_backend_gives_a_clear_message(ckpt, tmp_path):
    ok, msg = rendering_available("no-such-backend")
    assert not ok
    assert "MUJOCO_GL=no-such-backend" in msg and "rollout results are unaffected" in msg
    model = h.tiny_model("primal+dt", K=5)
    stats = {"state_mean": h.hopper_stats()[0], "state_std": h.hopper_stats()[1], "reward_scale": 1000.0}
    res = record_episode(model, SPEC, stats, 3600.0, "stream", 0, tmp_path, backend="no-such-backend")
    assert res["path"] is None and res["message"] == msg
    assert not list(tmp_path.glob("*.gif"))


@pytest.mark.slow
def test_video_is_recorded_when_rendering_works(tmp_path):
    ok, backend = rendering_available()
    if not ok:
        pytest.skip(backend)
    model = h.tiny_model("primal+dt", K=5)
    stats = {"state_mean": h.hopper_stats()[0], "state_std": h.hopper_stats()[1], "reward_scale": 1000.0}
    res = record_episode(model, SPEC, stats, 3600.0, "stream", 0, tmp_path, max_steps=20, size=64)
    assert Path(res["path"]).exists() and res["frames"] >= 2
