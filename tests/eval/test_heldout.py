"""eval.heldout: the held-out action error of each checkpoint's deployed engine, teacher-forced, on real Hopper
episodes held out by real training runs; equal to the trainer's own validation where the two count the same
predictions, and to the model's forward over the segments recompute shows."""

import json

import numpy as np
import pytest
import torch

import envs
from agents import dt_checkpoint
from eval import heldout
from primal_dt.train import run as train


@pytest.fixture(scope="module")
def runs(hopper_file, tmp_path_factory, tiny_train):
    """A standard (K-step segments) and a whole-episode run of a few steps, a quarter of the episodes held out."""
    out = tmp_path_factory.mktemp("heldout")
    common = ("steps=4", "val_fraction=0.25", *tiny_train.QUIET)
    return {name: train(tiny_train.args(hopper_file, out / name, *common, *extra))
            for name, extra in (("standard", ()), ("whole", ("whole_episodes=true", "eval.engine=stream")))}


def last_k_segments(ck, data):
    """Every step t of the episodes ``ck``'s run held out, as the segment recompute shows the model there: the last
    K steps ending at t (fewer at an episode's start), padding after t. Yields (model, held-out data, the episode's
    first row, t, the segment's first step, the batch)."""
    model, K, info = ck.build_model(), ck.model_config.K, ck.data
    held = data.subset(np.asarray(info.held_out))
    sampler = envs.SegmentSampler(held, K, 1, info.reward_scale, ck.config["max_timestep"], seed=None,
                                  stats=(info.state_mean, info.state_std))
    for start, n in zip(held.starts, held.lengths):
        for t in range(n):
            first = max(0, t - K + 1)
            idx = start + first + np.arange(K)
            idx[idx > start + t] = held.num_steps  # padding after step t
            yield model, held, start, t, first, sampler.batch(idx[None])


def test_the_stream_of_a_whole_episode_run_errs_as_its_trainers_validation_measured(runs):
    """The trainer validates a whole-episode run chunk after chunk through the recurrent forms; the tool walks the
    same held-out episodes step by step through the stream engine: two code paths, one number."""
    s = runs["whole"]
    rec = heldout.run([s["run_dir"]])[0]
    assert rec["engine"] == "stream" and rec["exact"] and rec["policy"] == "stream (exact, whole episodes)"
    assert rec["episodes"] == s["validation"]["episodes"] > 0
    assert rec["action_mse"] == pytest.approx(s["validation"]["action_mse"], rel=1e-5)


def test_recompute_errs_as_the_models_forward_over_the_last_K_steps(runs):
    """For a standard run the exact engine is recompute: at step t, the model's forward over the segment of the
    last K steps (fewer at an episode's start) ending at t, its last prediction against the dataset's action."""
    ck = dt_checkpoint.load(runs["standard"]["run_dir"])
    data = dt_checkpoint.training_data(ck, verbose=False)
    rec = heldout.heldout_errors(ck, data)
    assert rec["engine"] == "recompute" and rec["exact"]
    errors, bands = [], {n: [] for n in heldout.band_names()}
    for model, held, start, t, first, b in last_k_segments(ck, data):
        with torch.no_grad():
            pred, _ = model(b)
        err = ((pred[0, t - first] - torch.from_numpy(held.actions[start + t])) ** 2).tolist()
        errors += err
        bands[heldout.band_names()[np.searchsorted(heldout.BANDS, t, side="right") - 1]] += err
    assert rec["steps"] == int(held.lengths.sum())
    assert rec["action_mse"] == pytest.approx(np.mean(errors), rel=1e-5)
    for name, errs in bands.items():
        assert rec["by_timestep"][name] == (pytest.approx(np.mean(errs), rel=1e-5) if errs else None)
    # the stream of a segment-trained model is another policy: asked for, it is named so
    other = heldout.heldout_errors(ck, data, engine="stream")
    assert other["policy"] == "stream (not trained)" and not other["exact"] and other["action_mse"] != rec["action_mse"]


def test_the_response_to_a_target_is_how_far_the_forward_moves_when_conditioned_on_it(runs):
    """``target``: the walk again, conditioned on that return (R_t = (target - rewards so far) / reward_scale, as a
    rollout's stream computes it); the mean squared change of the predicted actions against the model's forward
    over the last K steps conditioned both ways, overall and by band."""
    ck = dt_checkpoint.load(runs["standard"]["run_dir"])
    data = dt_checkpoint.training_data(ck, verbose=False)
    target = 3600.0
    rec = heldout.heldout_errors(ck, data, target=target)
    plain = heldout.heldout_errors(ck, data)
    assert rec["action_mse"] == plain["action_mse"] and "target_response" not in plain  # the error is unchanged
    moved, bands = [], {n: [] for n in heldout.band_names()}
    for model, held, start, t, first, b in last_k_segments(ck, data):
        before = np.concatenate([[0.0], np.cumsum(held.rewards[start:start + t])])  # the rewards before each step
        rtg = torch.zeros_like(b.rtg)
        rtg[0, :t - first + 1, 0] = torch.from_numpy((target - before[first:t + 1]) / ck.data.reward_scale)
        with torch.no_grad():
            own, steered = model(b)[0][0, t - first], model(b._replace(rtg=rtg))[0][0, t - first]
        d = ((steered - own) ** 2).tolist()
        moved += d
        bands[heldout.band_names()[np.searchsorted(heldout.BANDS, t, side="right") - 1]] += d
    got = rec["target_response"]
    assert got["target"] == target and got["overall"] == pytest.approx(np.mean(moved), rel=1e-4) and got["overall"] > 0
    for name, ds in bands.items():
        assert got["by_timestep"][name] == (pytest.approx(np.mean(ds), rel=1e-4) if ds else None)


def test_the_command_pairs_each_training_with_recompute_on_the_same_seed(runs, tmp_path, run_cli):
    """The tables name each checkpoint's policy as eval.report does, and set each training against recompute's
    checkpoint of the same model and seed (the same held-out episodes): its mean error minus recompute's."""
    dirs = [runs["standard"]["run_dir"], runs["whole"]["run_dir"]]
    p = run_cli("eval.heldout", *dirs, f"out={tmp_path / 'rep'}")
    assert p.returncode == 0, p.stderr[-2000:]
    recs = json.loads((tmp_path / "rep" / "heldout.json").read_text())
    assert [r["policy"] for r in recs] == ["recompute", "stream (exact, whole episodes)"]
    assert recs[0]["held_out"] == recs[1]["held_out"]  # one seed, one split
    md = (tmp_path / "rep" / "heldout.md").read_text()
    assert "| checkpoint | model | seed | engine | weights | episodes | steps | action MSE | t 0-19 |" in md
    diff = recs[1]["action_mse"] - recs[0]["action_mse"]
    model = recs[0]["model"]
    bands = [(recs[1]["by_timestep"][b], recs[0]["by_timestep"][b]) for b in heldout.band_names()]
    by_band = " | ".join("" if a is None or b is None else f"{a - b:+.4f}" for a, b in bands)
    assert (f"| hopper-medium | {model} | stream (exact, whole episodes) | model | 1 | {recs[1]['action_mse']:.4f} | "
            f"{diff:+.4f} (1) | {by_band} |") in md
    assert any(a is not None for a, _ in bands) and "| t 0-19, minus recompute's |" in md
    assert f"| hopper-medium | {model} | recompute | model | 1 | {recs[0]['action_mse']:.4f} |  |" in md
    assert md.split("\n\n| checkpoint", 1)[1] in p.stdout  # what it wrote is what it printed
    assert "Command: `python -m eval.heldout " in md and "Machine: " in md
    assert "Response to the return target" not in md  # measured only when asked for

    p = run_cli("eval.heldout", *dirs, "target=3600", f"out={tmp_path / 'steered'}")
    assert p.returncode == 0, p.stderr[-2000:]
    recs = json.loads((tmp_path / "steered" / "heldout.json").read_text())
    md = (tmp_path / "steered" / "heldout.md").read_text()
    assert "Response to the return target 3600: the mean squared change of the predicted actions" in md
    for r in recs:
        resp = r["target_response"]
        cells = " | ".join("" if v is None else f"{v:.4f}" for v in resp["by_timestep"].values())
        assert (f"| hopper-medium | {model} | {r['policy']} | model | 1 | {resp['overall']:.4f} | {cells} |") in md


def test_a_run_without_held_out_episodes_or_average_is_one_clear_line(hopper_file, tmp_path, tiny_train, run_cli,
                                                                     one_line_error):
    s = train(tiny_train.args(hopper_file, tmp_path, "steps=1", "val_fraction=0", "ema_decay=0", *tiny_train.QUIET))
    one_line_error(run_cli("eval.heldout", s["run_dir"]), "held no episode out", "val_fraction > 0")
    one_line_error(run_cli("eval.heldout", s["run_dir"], "weights=ema"), "holds no moving average", "weights=model")
    one_line_error(run_cli("eval.heldout", s["run_dir"], "target=nan"), "target=nan", "give a finite return")
