"""The collector on real Hopper rollouts, a real SB3 policy and replay buffer, writing real
D4RL and Minari files that the loader reads back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from envs import behavior, load_dataset
from primal_dt.run import lock
from envs.collect import (
    CollectConfig,
    collect_rollouts,
    episodes_to_d4rl,
    main,
    parse,
    replay_episodes,
    rollout_episodes,
    run,
    select_checkpoints,
)
from envs.d4rl import read_d4rl, write_d4rl
from envs.vector import make_sim


def test_select_checkpoints_by_hand():
    evals = [{"step": 10, "return_mean": 300, "stoch_return_mean": 290},
             {"step": 20, "return_mean": 1000, "stoch_return_mean": 950},   # in band of 1078 +- 25%
             {"step": 30, "return_mean": 1100, "stoch_return_mean": 1080},  # closer, but later
             {"step": 40, "return_mean": 3000, "stoch_return_mean": 2900},
             {"step": 50, "return_mean": 2500, "stoch_return_mean": 2400}]
    med, exp = select_checkpoints(evals, CollectConfig(medium_tolerance=0.25))  # hopper: 1/3 of 3234.3
    assert (med["step"], exp["step"]) == (20, 40)
    med, _ = select_checkpoints(evals, CollectConfig())  # +-10%: 950 is out, 1080 in
    assert med["step"] == 30
    med, _ = select_checkpoints(evals, CollectConfig(medium_tolerance=0.001))
    assert med["step"] == 30  # nobody in the band: the closest
    med, _ = select_checkpoints(evals, CollectConfig(medium_return=2450, medium_tolerance=0.25))
    assert med["step"] == 40  # 2400 and 2900 are both within 25% of 2450; the earliest wins
    med, exp = select_checkpoints(evals, CollectConfig(medium_step=10, expert_step=50))
    assert (med["step"], exp["step"]) == (10, 50)
    with pytest.raises(ValueError, match="no checkpoint at step 15"):
        select_checkpoints(evals, CollectConfig(medium_step=15))


def _noisy_zero_policy(obs, eps):
    return np.zeros((len(obs), 3)) + (0.3 * eps if eps is not None else 0.0)


def test_rollouts_of_real_hopper_to_d4rl_and_back(tmp_path):
    make = lambda: make_sim("Hopper-v4")  # noqa: E731
    eps = rollout_episodes(_noisy_zero_policy, make, seeds=[5, 6, 7], act_dim=3)
    for ep in eps:
        n = len(ep["rewards"])
        assert ep["observations"].shape == (n + 1, 11) and ep["actions"].shape == (n, 3)
        assert ep["terminations"][-1] or ep["truncations"][-1]
        assert not (ep["terminations"][:-1] | ep["truncations"][:-1]).any()
    # an episode depends only on its seed, not on the episodes run beside it
    alone = rollout_episodes(_noisy_zero_policy, make, seeds=[6], act_dim=3)[0]
    np.testing.assert_array_equal(alone["observations"], eps[1]["observations"])
    arrays = episodes_to_d4rl(eps)
    np.testing.assert_array_equal(arrays["next_observations"][0], eps[0]["observations"][1])
    ds = read_d4rl(write_d4rl(tmp_path / "r.hdf5", arrays), "hopper-medium", "Hopper-v4")
    assert ds.lengths.tolist() == [len(e["rewards"]) for e in eps]
    assert ds.terminal.tolist() == [bool(e["terminations"][-1]) for e in eps]
    r = eps[2]["rewards"].astype(np.float64)
    np.testing.assert_allclose(ds.rtg[ds.starts[2]:], np.cumsum(r[::-1])[::-1], rtol=1e-5)


def _sac_run(wd: Path, **sim_kwargs):
    """A behaviour-policy directory as envs.behavior lays it out, made without gradient steps:
    two (untrained) checkpoints, their evals and a replay buffer of 300 random-action steps."""
    sb3 = pytest.importorskip("stable_baselines3")
    wd.mkdir()
    env = make_sim("Hopper-v4", **sim_kwargs)
    model = sb3.SAC("MlpPolicy", env, learning_starts=10_000, buffer_size=1000, seed=0, device="cpu")
    model.learn(300)
    behavior.save_checkpoint(model, wd / "sac_step0000100.pt")
    behavior.save_checkpoint(model, wd / "sac_step0000300.pt")
    behavior.save_replay(model, wd / "replay.npz")
    (wd / "evals.json").write_text(json.dumps([
        {"step": 100, "return_mean": 1000.0, "stoch_return_mean": 1050.0, "episodes": 1},
        {"step": 300, "return_mean": 3000.0, "stoch_return_mean": 3100.0, "episodes": 1}]))
    (wd / "meta.json").write_text(json.dumps({"env_id": "Hopper-v4", "seed": 0, "total_steps": 300}))
    return wd, model


@pytest.fixture
def sac_workdir(tmp_path):
    return _sac_run(tmp_path / "behavior")


def test_rollouts_resume_from_shards(sac_workdir, tmp_path):
    wd, _ = sac_workdir
    kw = dict(ckpt=wd / "sac_step0000100.pt", gym_id="Hopper-v4", act_dim=3, steps=40,
              seed0=11, num_envs=2, progress=False)
    first = collect_rollouts(cache=tmp_path / "c1", **kw)
    shards = sorted((tmp_path / "c1").glob("shard_*.npz"))
    assert sum(len(e["rewards"]) for e in first) >= 40 and len(shards) == len(first) // 2
    os.remove(shards[-1])  # as if killed before the last shard was saved
    again = collect_rollouts(cache=tmp_path / "c1", **kw)
    assert [e["seed"] for e in again] == [e["seed"] for e in first] == list(range(11, 11 + len(first)))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a["observations"], b["observations"])
        np.testing.assert_array_equal(a["actions"], b["actions"])


def test_replay_buffer_up_to_a_step(sac_workdir):
    wd, model = sac_workdir
    eps = replay_episodes(wd / "replay.npz", upto=200, action_space=model.action_space)
    rb = model.replay_buffer
    n = sum(len(e["rewards"]) for e in eps)
    assert 0 < n <= 200 and rb.dones[n - 1, 0] and not rb.dones[n:200, 0].any()  # fragment dropped
    flat = np.concatenate([e["observations"][:-1] for e in eps])
    np.testing.assert_array_equal(flat, rb.observations[:n, 0].astype(np.float32))
    last = len(eps[0]["rewards"]) - 1  # the final state comes from next_observations
    np.testing.assert_array_equal(eps[0]["observations"][-1], rb.next_observations[last, 0].astype(np.float32))


def test_medium_replay_is_every_transition_up_to_the_medium_step_in_order(tmp_path, data_dirs):
    """D4RL's medium-replay: every transition the behaviour policy's training saw until its medium
    checkpoint, in the order it saw them, split into episodes where the simulator ended them (true
    terminations as terminals, time-limit cuts as timeouts), the unfinished last one dropped. The SAC
    run here has a 25-step time limit so that both kinds of ending occur."""
    wd, model = _sac_run(tmp_path / "sac", max_episode_steps=25)
    prov = run(CollectConfig(env="hopper", level="medium-replay", workdir=str(wd), train=False, medium_step=100,
                             write_minari=False, next_observations=False, progress=False))
    path = data_dirs["replicas"] / "hopper_medium_replay-replica.hdf5"
    with h5py.File(path, "r") as f:  # D4RL's key layout, read with plain h5py
        assert set(f) == {"observations", "actions", "rewards", "terminals", "timeouts"}
        got = {k: f[k][()] for k in f}
    rb = model.replay_buffer  # what SAC saw, in its order (SB3 marks time-limit cuts in .timeouts)
    dones = np.flatnonzero(rb.dones[:100, 0])
    n = int(dones[-1]) + 1  # up to step 100, the unfinished episode dropped
    assert prov["policy_step"] == 100 and prov["steps"] == n == len(got["rewards"]) and n > 50
    np.testing.assert_array_equal(got["observations"], rb.observations[:n, 0].astype(np.float32))
    np.testing.assert_array_equal(got["actions"], rb.actions[:n, 0].astype(np.float32))  # Hopper's box is [-1, 1]
    np.testing.assert_array_equal(got["rewards"], rb.rewards[:n, 0].astype(np.float32))
    timeout = rb.timeouts[:n, 0].astype(bool)
    np.testing.assert_array_equal(got["timeouts"], timeout)
    np.testing.assert_array_equal(got["terminals"], rb.dones[:n, 0].astype(bool) & ~timeout)
    assert got["timeouts"].any() and got["terminals"].any()
    ds = read_d4rl(path, "hopper-medium-replay", "Hopper-v4")
    assert len(ds) == prov["episodes"] == len(dones)
    assert (ds.lengths[~ds.terminal] == 25).all() and (ds.lengths[ds.terminal] <= 25).all()  # cut only at the limit
    starts = np.concatenate([[0], dones[:-1] + 1])
    np.testing.assert_array_equal(ds.observations[ds.starts], rb.observations[starts, 0].astype(np.float32))


def test_collect_command_writes_both_formats(sac_workdir, data_dirs, capsys):
    wd, _ = sac_workdir
    prov = main(["env=hopper", "level=medium-expert", f"workdir={wd}", "train=false", "steps=30",
                 "num_envs=2", "progress=false"])
    out = capsys.readouterr().out
    assert "medium policy: step 100" in out and "expert policy: step 300" in out
    assert prov["policies"]["medium"]["step"] == 100 and prov["policies"]["expert"]["step"] == 300
    assert prov["ref_max_score"] == 3234.3 and prov["train_seed"] == 0
    assert prov["policies"]["medium"]["episode_seeds"][0] == 1_000_000
    with pytest.warns(UserWarning):
        d4 = load_dataset("hopper-medium-expert", source="replica", verbose=False)
    mi = load_dataset("hopper-medium-expert", source="minari:primal-dt/hopper/medium-expert-v0", verbose=False)
    assert len(d4) == len(mi) == prov["episodes"] and d4.num_steps == mi.num_steps == prov["steps"]
    np.testing.assert_array_equal(d4.observations, mi.observations)
    assert mi.metadata["policies"]["expert"]["step"] == 300 and mi.metadata["ref_min_score"] == -20.272305
    # medium-replay from the same directory; and no silent overwrite
    prov = run(CollectConfig(env="hopper", level="medium-replay", workdir=str(wd), train=False, progress=False))
    assert prov["policies"]["replay"]["episode_seeds"] == "SAC training (replay buffer)"
    assert load_dataset("hopper-medium-replay", source="minari:primal-dt/hopper/medium-replay-v0",
                        verbose=False).num_steps == prov["steps"]
    with pytest.raises(SystemExit, match="exists"):
        run(CollectConfig(env="hopper", level="medium-replay", workdir=str(wd), train=False, progress=False))


def test_collect_refuses_a_directory_being_trained(sac_workdir, data_dirs):
    """A live trainer holds the work directory's OS lock; collecting there (train=true) is one line naming it."""
    wd, _ = sac_workdir
    holder = subprocess.Popen(  # a live trainer holds the directory's lock
        [sys.executable, "-c", "import sys; from primal_dt.run import lock; lock.hold(sys.argv[1]); print(1, flush=True); "
         "sys.stdin.read()", str(wd)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        with pytest.raises(SystemExit, match=f"being trained by process {holder.pid}"):
            run(CollectConfig(workdir=str(wd), train=True, train_steps=10_000, progress=False))
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(SystemExit) as exit_:  # tyro's message: the levels it accepts
        parse(["level=random"])
    assert exit_.value.code == 2


@pytest.mark.slow
def test_train_behavior_then_collect(tmp_path, data_dirs):
    pytest.importorskip("stable_baselines3")
    wd = tmp_path / "sac"
    cfg = dict(env="hopper", level="medium", workdir=str(wd), train_steps=400, checkpoint_every=200,
               steps=50, num_envs=2, progress=False)
    prov = run(CollectConfig(**cfg))
    assert sorted(p.name for p in wd.glob("sac_step*.pt")) == ["sac_step0000200.pt", "sac_step0000400.pt"]
    assert [e["step"] for e in json.loads((wd / "evals.json").read_text())] == [200, 400]
    assert lock.holder(wd) is None  # released
    with pytest.warns(UserWarning):
        ds = load_dataset("hopper-medium", source="replica", verbose=False)
    assert ds.num_steps == prov["steps"] >= 50
    # training resumes from the plain-tensor checkpoint and the replay arrays (no pickle involved)
    before = behavior.load_replay(wd / "replay.npz")
    behavior.train_behavior(wd, behavior.BehaviorConfig(env_id="Hopper-v4", total_steps=600, checkpoint_every=200),
                            progress=False)
    ck = behavior.load_checkpoint(wd / "sac_step0000600.pt")
    assert ck["num_timesteps"] == 600 and ck["n_updates"] > behavior.load_checkpoint(wd / "sac_step0000400.pt")["n_updates"]
    replay, n = behavior.load_replay(wd / "replay.npz"), int(before["pos"])
    assert int(replay["pos"]) > n > 300  # the buffer went on from where it was ...
    np.testing.assert_array_equal(replay["observations"][:n], before["observations"][:n])  # ... and kept its past


def test_options_that_would_waste_the_training_are_refused_first(tmp_path, capsys):
    """Each was found only when the data was written, after hours of SAC; a work directory where a file is, a
    traceback."""
    (tmp_path / "file").write_text("")
    for argv, message in [(["write_d4rl=false", "write_minari=false"], "leave nothing to write"),
                          ([f"out={tmp_path / 'file'}"], "is a file; give the directory"),
                          (["train_steps=10", "checkpoint_every=100"], "no policy would be saved")]:
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "progress=false"])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    pytest.importorskip("stable_baselines3")
    with pytest.raises(SystemExit, match=f"error: could not write the lock file .*{tmp_path / 'file'}"):
        main([f"workdir={tmp_path / 'file'}", f"out={tmp_path / 'data'}", "overwrite=true", "progress=false"])


def test_every_numeric_option_is_valid_or_named(fuzz_options):
    """Any value for the collector's numeric options: ``check`` accepts it or stops with one line naming
    one of them (before a policy is trained or a file touched)."""
    from envs.collect import check, parse

    def validate(argv):
        check(parse(argv))

    ints = ("train_steps", "checkpoint_every", "seed", "rollout_seed", "steps", "medium_step", "expert_step",
            "num_envs", "threads")
    floats = ("medium_fraction", "medium_return", "medium_tolerance")
    fuzz_options(validate, {**{k: "int" for k in ints}, **{k: "float" for k in floats}}, examples=80)


def test_the_saved_actor_acts_as_stable_baselines3s(sac_workdir):
    """Rolling out reads the plain-tensor checkpoint, never SB3's pickle, and acts as SB3's actor."""
    import torch

    from envs.collect import SACPolicy

    wd, model = sac_workdir
    policy = SACPolicy(wd / "sac_step0000300.pt", model)
    obs = np.random.default_rng(0).normal(size=(4, 11))
    eps = np.random.default_rng(1).normal(size=(4, 3))
    with torch.no_grad():
        mean, log_std, _ = model.actor.get_action_dist_params(torch.as_tensor(obs, dtype=torch.float32))
    low, high = model.action_space.low, model.action_space.high
    for e, u in ((None, mean.double().numpy()), (eps, mean.double().numpy() + np.exp(log_std.double().numpy()) * eps)):
        np.testing.assert_allclose(policy(obs, e), low + 0.5 * (np.tanh(u) + 1) * (high - low), rtol=1e-6, atol=1e-7)


PAYLOAD = "__import__('pathlib').Path({marker!r}).write_text('ran')"


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (eval, (PAYLOAD.format(marker=str(self.marker)),))


def collect_cli(wd, *extra):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "envs.collect", "env=hopper", f"workdir={wd}", "train=false",
                           "progress=false", "steps=10", "num_envs=1", *extra], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])


def test_pickled_files_are_never_run(tmp_path):
    """Crafted checkpoints or replay arrays holding a pickle payload, and stable-baselines3's own pickles
    beside them: refused with one line, the payload never runs (its marker file never appears), and torch's
    own warnings about the pickle are not printed."""
    import pickle

    import torch

    marker = tmp_path / "payload-ran"
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    torch.save({"params": {"policy": Payload(marker)}}, crafted / "sac_step0000100.pt")
    (crafted / "sac_step0000050.zip").write_bytes(pickle.dumps(Payload(marker)))  # SB3's format: never read
    (crafted / "replay.pkl").write_bytes(pickle.dumps(Payload(marker)))
    (crafted / "evals.json").write_text(json.dumps([{"step": 100, "return_mean": 1.0, "stoch_return_mean": 1.0}]))
    p = collect_cli(crafted)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "sac_step0000100.pt was not loaded: it holds pickled objects" in p.stderr

    with pytest.raises(ValueError, match="replay.npz is not a replay buffer of arrays"):
        replay_episodes(crafted / "replay.npz", 10)  # absent: replay.pkl beside it is not read instead
    np.savez(crafted / "replay.npz", observations=np.array([Payload(marker)], dtype=object))
    with pytest.raises(ValueError, match="replay.npz is not a replay buffer of arrays"):
        replay_episodes(crafted / "replay.npz", 10)
    assert not marker.exists()


@pytest.mark.parametrize("name, text", [
    ("meta.json", '{"env_id": "Hopper-v4"}'),  # a field missing (KeyError before)
    ("meta.json", '{"env_id": 5, "seed": 0, "total_steps": 10}'),
    ("meta.json", "[1, 2]"),
    ("evals.json", '[{"step": "x", "return_mean": 1}]'),  # TypeError before
    ("evals.json", '{"step": 1}'),
    ("evals.json", "[" * 5000 + "]" * 5000),  # RecursionError before
])
def test_a_malformed_work_file_is_one_error_naming_it(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    reader = behavior.read_meta if name == "meta.json" else behavior.read_evals
    with pytest.raises(ValueError, match=str(tmp_path / name)):
        reader(tmp_path)


def test_a_shard_whose_lengths_exceed_its_arrays_is_refused(tmp_path):
    """A damaged rollout shard (its episode lengths claim more steps than its arrays hold) is one error
    naming it, not episodes silently cut short."""
    from envs.collect import _load_shard, _save_shard

    g = np.random.default_rng(0)
    eps = [{"observations": g.normal(size=(n + 1, 11)).astype(np.float32), "actions": np.zeros((n, 3), np.float32),
            "rewards": np.ones(n, np.float32), "terminations": np.zeros(n, bool), "truncations": np.eye(1, n, n - 1,
            dtype=bool)[0], "seed": s} for s, n in ((1, 5), (2, 7))]
    _save_shard(tmp_path / "shard_000000.npz", eps)
    assert [len(e["rewards"]) for e in _load_shard(tmp_path / "shard_000000.npz")] == [5, 7]
    z = dict(np.load(tmp_path / "shard_000000.npz"))
    np.savez(tmp_path / "shard_000002.npz", **{**z, "lengths": np.array([5, 70])})
    with pytest.raises(ValueError, match=r"shard_000002\.npz is damaged: its 2 episode lengths \(total 75\)"):
        _load_shard(tmp_path / "shard_000002.npz")
