"""Validation without a simulator (``agents.training.Validation``, ``val_fraction``): whole episodes held
out by the run's seed, never trained on, their masked action MSE logged every ``eval.every`` steps and
at the end, checked against a computation written from the raw episodes. Real Hopper data through
the real loader, the real trainer and the real simulator evaluation, made tiny."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import envs
from agents import dt_checkpoint, training
from agents.decision_transformer import Batch
from agents import train_config
from primal_dt.run.errors import SetupError
from primal_dt.train import run as train_run


def episode_of_rows(data):
    """Each dataset row's (episode, step), keyed by its action's bytes (noisy floats: unique, checked)."""
    ep = np.repeat(np.arange(len(data)), data.lengths)
    where = {data.actions[i].tobytes(): (int(ep[i]), int(data.timesteps[i])) for i in range(data.num_steps)}
    assert len(where) == data.num_steps
    return where


def same(x: Batch, y: Batch) -> bool:
    return all(u is v or torch.equal(u, v) for u, v in zip(x, y))


def direct_action_mse(ck, data, max_timestep=1000):
    """The held-out episodes' masked action MSE written from the formula: every K-step segment that
    starts at a step of a held-out episode, right-padded, normalised with the checkpoint's statistics,
    returns-to-go as suffix sums of the raw rewards divided by the checkpoint's scale."""
    K, info = ck.model_config.K, ck.data
    S, A, G, T, M = [], [], [], [], []
    for e in info.held_out:
        ep = data.episodes[e]
        n = len(ep["rewards"])
        rtg = np.cumsum(ep["rewards"][::-1].astype(np.float64))[::-1]
        for t in range(n):
            m = min(K, n - t)
            s, a, g, ts = (np.zeros((K, ep["observations"].shape[1])), np.zeros((K, ep["actions"].shape[1])),
                           np.zeros(K), np.zeros(K, dtype=np.int64))
            s[:m] = (ep["observations"][t:t + m] - info.state_mean) / info.state_std
            a[:m] = ep["actions"][t:t + m]
            g[:m] = rtg[t:t + m] / info.reward_scale
            ts[:m] = np.minimum(np.arange(t, t + m), max_timestep - 1)
            S.append(s), A.append(a), G.append(g), T.append(ts), M.append(np.arange(K) < m)
    states, actions, rtg = (torch.tensor(np.array(x), dtype=torch.float32) for x in (S, A, G))
    rtg, mask = rtg[..., None], torch.tensor(np.array(M))
    with torch.no_grad():
        pred, _ = ck.build_model()(Batch(states, actions, rtg, torch.tensor(np.array(T)), mask))
    m = mask[..., None].double()
    return float((((pred.double() - actions.double()) ** 2) * m).sum() / (m.sum() * actions.shape[-1])), len(S)


def test_training_segments_never_include_held_out_episodes_and_statistics_exclude_them(hopper_file, tmp_path, tiny_train):
    run = training.prepare(train_config.build(tiny_train.args(hopper_file, tmp_path, "val_fraction=0.25", "seed=4", *tiny_train.QUIET)))
    data, held = run.data, set(run.info.held_out)
    assert len(held) == 6 and held == set(data.hold_out(0.25, seed=4)[1].tolist())  # round(0.25 * 24), by the seed
    where = episode_of_rows(data)
    seen = set()
    for _ in range(100):  # 100 batches of 64 segments from the trainer's own sampler
        b = run.sampler.sample(64)
        for i in range(64):
            rows = [where[b.actions[i, t].numpy().tobytes()] for t in range(int(b.mask[i].sum()))]
            (ep,) = {e for e, _ in rows}  # a segment stays in one episode, on consecutive steps
            assert [t for _, t in rows] == list(range(rows[0][1], rows[0][1] + len(rows)))
            seen.add(ep)
    assert not seen & held, f"held-out episodes {sorted(seen & held)} were trained on"
    assert seen == set(range(len(data))) - held  # and every training episode was
    train_obs = np.concatenate([data.episodes[e]["observations"] for e in sorted(seen)]).astype(np.float64)
    np.testing.assert_allclose(run.info.state_mean, train_obs.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run.info.state_std, train_obs.std(0) + 1e-6, rtol=1e-5)
    assert not np.allclose(run.info.state_mean, data.state_mean, atol=1e-4)  # the held-out ones would move them


def test_validation_is_logged_every_eval_every_and_at_the_end_and_equals_the_formula(hopper_file, tmp_path, capsys, tiny_train):
    s = train_run(tiny_train.args(hopper_file, tmp_path, "steps=10", "val_fraction=0.2", "eval.every=5", "eval.episodes=1",
                       "eval.final_episodes=0", "eval.max_steps=5", "eval.num_envs=1", "checkpoint_every=5"))
    d = Path(s["run_dir"])
    ck = dt_checkpoint.load(d)
    data = envs.load_dataset("hopper-medium", source=f"d4rl:{hopper_file}", verbose=False)
    mse, segments = direct_action_mse(ck, data)
    saved = json.loads((d / "summary.json").read_text())["validation"]
    assert saved["action_mse"] == pytest.approx(mse, rel=1e-5)
    assert saved["episodes"] == len(ck.data.held_out) == 5 and saved["segments"] == segments
    assert saved["val_fraction"] == 0.2
    tb = tiny_train.scalars(d, "val/action_mse")
    assert [step for step, _ in tb] == [5, 10] and tb[-1][1] == pytest.approx(mse, rel=1e-5)
    (kept,) = ck.training.history["val/action_mse"]  # the curve a resumed run goes on drawing
    assert kept == (5, pytest.approx(tb[0][1], rel=1e-6))
    assert "validation action MSE" in capsys.readouterr().out
    assert (d / "val_action_mse.png").stat().st_size > 1000


def test_validation_runs_without_the_simulator_and_is_deterministic(hopper_file, tmp_path, tiny_train):
    """Cadence from eval.every with the final simulator evaluation off; the same weights give the same
    number; no random stream moves and the model's training mode comes back."""
    s = train_run(tiny_train.args(hopper_file, tmp_path / "a", "steps=6", "eval.every=0", "eval.final_episodes=0"))
    assert s["final"] is None and s["validation"]["action_mse"] > 0
    assert [step for step, _ in tiny_train.scalars(s["run_dir"], "val/action_mse")] == [6]
    run = training.prepare(train_config.build(tiny_train.args(hopper_file, tmp_path / "b", *tiny_train.QUIET)))
    torch_state, sampler_state = torch.get_rng_state(), run.sampler.state_dict()
    assert run.model.training
    a, b = run.validation.action_mse(run.model), run.validation.action_mse(run.model)
    assert a == b and run.model.training
    assert torch.equal(torch.get_rng_state(), torch_state) and run.sampler.state_dict() == sampler_state
    run.model.train()
    with torch.no_grad():
        next(run.model.parameters()).add_(0.1)
    assert run.validation.action_mse(run.model) != a  # it measures the model


def test_val_fraction_zero_turns_validation_off(hopper_file, tmp_path, tiny_train):
    s = train_run(tiny_train.args(hopper_file, tmp_path, "steps=4", "val_fraction=0", "eval.every=2", "eval.episodes=1",
                       "eval.final_episodes=0", "eval.max_steps=3", "eval.num_envs=1"))
    assert s["validation"] is None and tiny_train.scalars(s["run_dir"], "val/action_mse") == []
    ck = dt_checkpoint.load(s["run_dir"])
    data = envs.load_dataset("hopper-medium", source=f"d4rl:{hopper_file}", verbose=False)
    assert ck.data.held_out == () and np.array_equal(ck.data.state_mean, data.state_mean)


def test_a_dataset_that_cannot_spare_an_episode_is_a_clear_error(hopper_file, tmp_path, tiny_train):
    from envs.d4rl import write_d4rl

    ep = envs.load_dataset("hopper-medium", source=f"d4rl:{hopper_file}", verbose=False).episodes[0]
    n = len(ep["rewards"])
    one = write_d4rl(tmp_path / "one-episode.hdf5", {
        "observations": ep["observations"], "actions": ep["actions"], "rewards": ep["rewards"],
        "terminals": ep["dones"], "timeouts": (np.arange(n) == n - 1) & ~ep["dones"]})
    argv = [*tiny_train.TINY, f"data_source=d4rl:{one}", f"out={tmp_path / 'out'}", *tiny_train.QUIET]
    with pytest.raises(SetupError, match=r"val_fraction=0.05 holds out whole episodes for validation: .*one-episode"
                                         r".hdf5: holding out 1 of its 1 episode\(s\).*Set val_fraction=0"):
        train_run(argv)
    assert not (tmp_path / "out").exists()
    assert train_run([*argv, "steps=2", "val_fraction=0"])["steps"] == 2


def test_resume_keeps_the_split_and_refuses_another(hopper_file, tmp_path, capsys, tiny_train):
    s = train_run(tiny_train.args(hopper_file, tmp_path, "steps=3", "val_fraction=0.2", *tiny_train.QUIET))
    d = Path(s["run_dir"])
    held = dt_checkpoint.load(d).data.held_out
    resumed = train_run([f"resume={d}", "steps=5", "progress=false", "threads=1"])
    assert resumed["validation"]["episodes"] == len(held) == 5 and dt_checkpoint.load(d).data.held_out == held
    with pytest.raises(SetupError, match="last.pt was trained with val_fraction=0.2, but the command line asks for "
                                         "val_fraction=0.1"):
        train_run([f"resume={d}", "steps=6", "val_fraction=0.1"])
    tampered = dt_checkpoint.load(d)
    tampered.data.held_out = tuple(sorted(set(range(24)) - set(held)))[:len(held)]
    dt_checkpoint.save(tampered, d / "last.pt")
    with pytest.raises(SetupError, match="held out episodes .* for validation, but the split recomputed from seed=0"):
        train_run([f"resume={d}", "steps=6"])


def test_many_held_out_steps_are_validated_on_a_fixed_seeded_sample(tiny_dt, hopper_stats):
    from agents.dt_checkpoint import DataInfo
    from agents.training import MAX_SEGMENTS, Validation

    rng = np.random.default_rng(0)
    n = 3 * MAX_SEGMENTS - 144  # 60 episodes of 100 steps
    held = envs.Trajectories(observations=rng.standard_normal((n, 11)), actions=rng.uniform(-1, 1, (n, 3)),
                             rewards=rng.uniform(0, 3, n), starts=np.arange(0, n, 100), lengths=np.full(60, 100),
                             terminal=np.zeros(60, bool))
    info = DataInfo("hopper-medium", *hopper_stats, reward_scale=1000.0)
    a, b, other = (Validation(held, info, K=5, max_timestep=1000, seed=s, device=torch.device("cpu")) for s in (1, 1, 2))
    assert a.segments == MAX_SEGMENTS and same(a.batch, b.batch)
    assert not torch.equal(a.batch.actions, other.batch.actions)  # the seed draws the sample
    row = {held.actions[i].tobytes(): i for i in range(n)}
    starts = [row[x.tobytes()] for x in a.batch.actions[:, 0].numpy()]
    assert len(set(starts)) == MAX_SEGMENTS  # distinct segments, each the sampler's segment at its start
    fixed = envs.SegmentSampler(held, 5, 1, 1000.0, seed=None, stats=hopper_stats).segments(np.array(starts))
    assert same(a.batch, fixed)
    model = tiny_dt()
    assert a.action_mse(model) == b.action_mse(model) != other.action_mse(model)
