"""agents.training, the DT trainer, on real Hopper data: the evaluation hook it is handed, the
batches it trains on, and the checkpoint it writes and resumes from (through agents.dt_checkpoint).
The end-to-end command (``python -m primal_dt.train``) is tests/primal_dt/test_train.py."""

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from agents import dt_checkpoint, training
from agents.dt_checkpoint import DataInfo
from agents import train_config
from primal_dt.run.errors import SetupError

TINY = ["preset=smoke", "progress=false", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.s=8",
        "K=5", "batch_size=8", "warmup_steps=5", "threads=1", "tensorboard=false"]
QUIET = ["eval.every=0", "eval.final_episodes=0"]


def args(hopper_file, out, *extra):
    return [*TINY, f"data_source=d4rl:{hopper_file}", f"out={out}", *extra]


class RecordingEvaluator:
    """An evaluator that records what the trainer asks for, and draws from torch's generator as a
    real rollout's sampling would."""

    def __init__(self):
        self.calls = []

    def rollout(self, model, data, episodes, seed, settings, on_step=None):
        torch.rand(100)
        self.calls.append({"model": model, "data": data, "episodes": episodes, "seed": seed, "settings": settings})
        return {t: {"normalized_mean": 10.0 + i, "normalized_std": 1.0, "return_mean": 100.0, "return_std": 2.0,
                    "length_mean": 50.0, "returns": [100.0] * episodes} for i, t in enumerate(data.targets)}

    def evaluator(self):
        return training.Evaluator(rollout=self.rollout, line=lambda res: f"FAKE {len(res)} targets")


def train(argv, evaluator=None):
    return training.train(train_config.build(argv), evaluator or RecordingEvaluator().evaluator())


def test_the_evaluator_gets_the_runs_data_and_leaves_training_untouched(hopper_file, tmp_path, capsys):
    rec = RecordingEvaluator()
    s = train(args(hopper_file, tmp_path / "a", "steps=6", "eval.every=2", "eval.episodes=1", "eval.final_episodes=3",
                   "eval.targets=3000,1500"), rec.evaluator())
    assert [(c["episodes"], c["seed"]) for c in rec.calls] == [(1, 10_000), (1, 10_000), (3, 20_000)]  # steps 2, 4; final
    ck = dt_checkpoint.load(s["run_dir"])
    for c in rec.calls:
        data = c["data"]
        assert isinstance(data, DataInfo) and data.targets == (3000.0, 1500.0) and data.reward_scale == 1000.0
        np.testing.assert_array_equal(data.state_mean, ck.data.state_mean)
        assert c["settings"].episodes == 1 and isinstance(c["model"], torch.nn.Module)
    assert s["final"]["target3000"] == {"normalized_mean": 10.0, "normalized_std": 1.0, "return_mean": 100.0,
                                        "return_std": 2.0, "length_mean": 50.0, "episodes": 3}
    assert "step 2: eval (1 episodes/target" in capsys.readouterr().out
    assert ck.training.history["eval/normalized/target1500"] == [(2, 11.0), (4, 11.0)]
    # evaluation draws random numbers, yet the trained weights equal those of a run without it
    quiet = train(args(hopper_file, tmp_path / "b", "steps=6", *QUIET))
    a, b = ck.model, dt_checkpoint.load(quiet["run_dir"]).model
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_batches_divide_returns_to_go_by_reward_scale(hopper_file, tmp_path):
    run = training.prepare(train_config.build(args(hopper_file, tmp_path, "reward_scale=500", *QUIET)))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # preparing writes nothing
    state = run.sampler.state_dict()
    idx, mask = run.sampler.indices()
    run.sampler.load_state_dict(state)
    batch = run.sampler.sample()
    trained = run.data.subset(np.setdiff1d(np.arange(len(run.data)), run.info.held_out))  # the sampler's rows
    np.testing.assert_allclose(batch.rtg[..., 0][torch.from_numpy(mask)].numpy(), trained.rtg[idx[mask]] / 500,
                               rtol=1e-6)
    assert run.info.reward_scale == 500.0 and batch.states.shape == (8, 5, 11)


def test_from_start_trains_and_validates_on_episode_prefixes(hopper_file, tmp_path):
    run = training.prepare(train_config.build(args(hopper_file, tmp_path, "from_start=true", "K=40",
                                                   "max_timestep=40", "val_fraction=0.2", *QUIET)))
    batch = run.sampler.sample()
    assert (batch.timesteps[:, 0] == 0).all() and batch.states.shape[1] == 40  # each segment begins its episode
    v = run.validation
    assert v.segments == v.episodes > 0 and (v.batch.timesteps[:, 0] == 0).all()  # one prefix per held-out episode


def test_checkpoint_is_the_schema_and_resume_refuses_what_it_cannot_continue(hopper_file, tmp_path,
                                                                           write_hopper_file):
    s = train(args(hopper_file, tmp_path, "steps=2", *QUIET))
    raw = torch.load(Path(s["run_dir"]) / "last.pt", weights_only=True)  # tensors and plain data only
    assert raw["schema"] == dt_checkpoint.SCHEMA_VERSION and raw["kind"] == "dt"
    ck = dt_checkpoint.load(s["run_dir"])
    assert ck.step == 2 and ck.config["steps"] == 2 and ck.model_config.K == 5
    (rng,) = ck.training.rng
    assert set(rng) >= {"torch", "numpy", "sampler"}

    inference_only = tmp_path / "inference"
    dt_checkpoint.save(dt_checkpoint.DTCheckpoint(ck.model_config, ck.model, ck.data, ck.config),
                       inference_only / "last.pt")
    with pytest.raises(SetupError, match="holds no training state .* cannot be resumed"):
        train([f"resume={inference_only}"])

    other = write_hopper_file(tmp_path / "hopper_rollouts-v2.hdf5", seed=1)  # other episodes, other statistics
    moved = tmp_path / "moved"
    shutil.copytree(s["run_dir"], moved)
    saved = dt_checkpoint.load(moved)
    saved.config["data_source"] = f"d4rl:{other}"
    dt_checkpoint.save(saved, moved / "last.pt")
    with pytest.raises(SetupError, match=f"was trained on d4rl:{hopper_file} .*but the data read now from "
                                         f"d4rl:{other} differs"):
        train([f"resume={moved}"])


def test_a_resume_whose_random_state_is_truncated_is_one_error_naming_the_file(hopper_file, tmp_path):
    """A checkpoint whose torch RNG state lost bytes (safe to read, right type, wrong size) is refused with
    one SetupError naming the file, not torch's traceback from ``set_rng_state``."""
    s = train(args(hopper_file, tmp_path, "steps=2", *QUIET))
    path = Path(s["run_dir"]) / "last.pt"
    raw = torch.load(path, weights_only=True)
    raw["rng"][0]["torch"] = raw["rng"][0]["torch"][:100]
    torch.save(raw, path)
    before = path.read_bytes()
    with pytest.raises(SetupError, match=rf"^checkpoint {re.escape(str(path))}: its training state does not fit the "
                                         r"run it describes \(RuntimeError: .*size.*\); the file is damaged"):
        train([f"resume={s['run_dir']}"])
    assert path.read_bytes() == before


def test_a_resume_whose_optimizer_moments_are_mis_shaped_is_one_error_naming_the_file(hopper_file, tmp_path):
    """Adam's moments of another shape load without complaint (``load_state_dict`` checks no shape) and broke the
    first step with torch's traceback; they are refused at the resume, naming the file."""
    s = train(args(hopper_file, tmp_path, "steps=2", *QUIET))
    path = Path(s["run_dir"]) / "last.pt"
    raw = torch.load(path, weights_only=True)
    moments = raw["optimizer"]["state"][0]
    moments["exp_avg"] = torch.zeros(3)
    torch.save(raw, path)
    with pytest.raises(SetupError, match=rf"^checkpoint {re.escape(str(path))}: its training state does not fit the "
                                         r"run it describes \(ValueError: optimizer state exp_avg has shape \(3,\)"):
        train([f"resume={s['run_dir']}", "steps=4"])


def test_a_bf16_run_of_primal_layers_on_a_gpu_is_warned_and_no_other():
    """primal+dt collapsed in bf16 on a GPU (docs/results/gpu-h200-recipe-bf16.md): such a run says so at its start;
    float32, a CPU and a model without primal layers are not warned."""
    from agents.training import bf16_gpu_note

    assert bf16_gpu_note("bf16", torch.device("cuda", 0), ["softmax", "softmax", "primal"]).startswith("warning: ")
    assert not bf16_gpu_note("off", torch.device("cuda"), ["primal"])
    assert not bf16_gpu_note("bf16", torch.device("cpu"), ["primal"])
    assert not bf16_gpu_note("bf16", torch.device("cuda"), ["softmax", "softmax", "softmax"])


def test_amp_bf16_trains_says_so_and_stays_the_runs_precision_on_resume(hopper_file, tmp_path, capsys):
    s = train(args(hopper_file, tmp_path, "steps=4", "amp=bf16", *QUIET))
    assert "training step eager (compile=auto) in bf16 autocast" in capsys.readouterr().out
    assert dt_checkpoint.load(s["run_dir"]).config["amp"] == "bf16"
    with pytest.raises(SetupError, match="amp"):
        train([f"resume={s['run_dir']}", "steps=6", "amp=off"])


def test_the_moving_average_of_the_weights_is_torchs_ema_saved_and_resumed_exactly(hopper_file, tmp_path):
    """``ema_decay``: the checkpoint carries the average (first step's weights, then lerp by 1 - decay each step);
    it never changes the trained weights, and a resumed run continues it exactly."""
    run = lambda name, *extra: dt_checkpoint.load(train(args(hopper_file, tmp_path / name, *QUIET, *extra))["run_dir"])
    one, two = run("one", "steps=1", "ema_decay=0.5"), run("two", "steps=2", "ema_decay=0.5")
    assert all(torch.equal(one.ema[k], one.model[k]) for k in one.model)  # the average starts at the first step
    for k in two.model:  # then half the last average, half the new weights
        torch.testing.assert_close(two.ema[k], 0.5 * one.model[k] + 0.5 * two.model[k], rtol=1e-6, atol=1e-7)
    plain = run("plain", "steps=2", "ema_decay=0")
    assert plain.ema is None and all(torch.equal(plain.model[k], two.model[k]) for k in two.model)
    with pytest.raises(ValueError, match="holds no moving average of its weights .* use weights=model"):
        plain.build_model(weights="ema")
    straight = run("straight", "steps=4")
    first = train(args(hopper_file, tmp_path / "split", *QUIET, "steps=2"))["run_dir"]
    resumed = dt_checkpoint.load(train([*TINY, f"resume={first}", "steps=4"])["run_dir"])
    assert all(torch.equal(resumed.ema[k], straight.ema[k]) for k in straight.ema)
    assert not all(torch.equal(straight.ema[k], straight.model[k]) for k in straight.model)
    ema_model = straight.build_model(weights="ema")
    assert all(torch.equal(v, straight.ema[k]) for k, v in ema_model.state_dict().items())


def test_a_cosine_rate_falls_from_the_warm_up_to_lr_min_at_the_last_step_and_resumes_on_its_course(hopper_file, tmp_path):
    """``lr_schedule=cosine``: the rate of every step, as TensorBoard logs it, is the formula's (linear warm-up over
    3 steps, then lr_min + (1 - lr_min) (1 + cos(pi t)) / 2 with t going from 0 at the warm-up's last step to 1 at
    the run's last), the last step trains at lr_min x lr, and a run stopped half way resumes on the same course."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lr, lr_min, steps, warm = 1e-3, 0.2, 12, 3

    def rate(step):  # of 0-based step `step`
        if step < warm:
            return lr * (step + 1) / warm
        t = (step + 1 - warm) / (steps - warm)
        return lr * (lr_min + (1 - lr_min) * (1 + math.cos(math.pi * t)) / 2)

    opts = ["eval.final_episodes=0", "lr_schedule=cosine", f"lr_min={lr_min}", f"lr={lr}", f"warmup_steps={warm}",
            "log_every=1"]
    whole = train(args(hopper_file, tmp_path / "whole", f"steps={steps}", "tensorboard=true", "eval.every=0", *opts))

    def stop(*_, **__):  # Ctrl-C at the evaluation after step 6: the trainer keeps the step reached
        raise KeyboardInterrupt

    cut = args(hopper_file, tmp_path / "cut", f"steps={steps}", "tensorboard=false", *opts, "eval.every=6",
               "eval.episodes=1")
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        train(cut, training.Evaluator(rollout=stop, line=str))
    (half,) = (tmp_path / "cut").glob("*/*/*-seed0")
    assert dt_checkpoint.load(half).step == 6
    ck = dt_checkpoint.load(whole["run_dir"])
    assert rate(steps - 1) == pytest.approx(lr * lr_min)
    assert ck.training.optimizer["param_groups"][0]["lr"] == pytest.approx(lr * lr_min)  # and it stays there
    acc = EventAccumulator(str(whole["run_dir"]), size_guidance={"scalars": 0})
    acc.Reload()
    logged = {e.step: e.value for e in acc.Scalars("train/lr")}
    assert sorted(logged) == list(range(1, steps + 1))
    for step, value in logged.items():  # logged after step `step` (1-based): the rate the next step will take
        assert value == pytest.approx(rate(min(step, steps - 1)), rel=1e-6)
    resumed = training.train(train_config.build(["progress=false", f"resume={half}"]),
                             RecordingEvaluator().evaluator())
    a, b = dt_checkpoint.load(whole["run_dir"]), dt_checkpoint.load(resumed["run_dir"])
    assert b.training.optimizer["param_groups"][0]["lr"] == pytest.approx(a.training.optimizer["param_groups"][0]["lr"])
    for k, v in a.model.items():
        torch.testing.assert_close(b.model[k], v, rtol=0, atol=0)
