"""Honest long runs (agents.training_time, ``checkpoint_minutes``): the trainer projects its duration
from its measured pace, says plainly when the recipe takes hours here and prints a budget command
that fits; checkpoints come by wall time too, so a run stopped before its first step checkpoint
resumes exactly; the progress bar shows loss, last score, last validation MSE and time left. Real
processes, real signals, real Hopper data, tiny models."""

import dataclasses
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from agents import dt_checkpoint, training, training_time
from primal_dt import train_config
from primal_dt.train import run as train_run

ROOT = Path(__file__).resolve().parents[2]
TINY = ["preset=smoke", "progress=false", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.s=8",
        "K=5", "batch_size=8", "warmup_steps=5", "threads=1"]
QUIET = ["eval.every=0", "eval.final_episodes=0"]
SCALED = {"steps", "warmup_steps", "eval.every", "checkpoint_every", "eval.final_episodes"}


def args(hopper_file, out, *extra):
    return [*TINY, f"data_source=d4rl:{hopper_file}", f"out={out}", *extra]


def start(argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PRIMAL_DT_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "primal_dt.train", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_recipe_of_hours_says_so_and_prints_a_budget_command_that_fits(hopper_file, tmp_path):
    """A dataset without a CPU recipe (hopper-expert: any hopper file serves it) gets its own recipe, shorter."""
    argv = args(hopper_file, tmp_path, "env=hopper-expert", "steps=10000000", "warmup_steps=1000000", "eval.every=1000000",
                "eval.episodes=1", "eval.final_episodes=2", "eval.max_steps=10", "eval.num_envs=2",
                "checkpoint_every=500000", "seed=7", "model.dropout=0.2", "lr=0.0005")
    proc = start(argv)
    lines, deadline = [], time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if lines[-1].startswith("  python -m primal_dt.train"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    text = "\n".join(lines)
    pace = re.search(r"^time on cpu, 1 thread, measured over (\d+) steps: 10,000,000 steps x ([\d.]+) ms = .*"
                     r"about (\S+) in all$", text, re.MULTILINE)
    assert pace, text[-3000:]
    assert int(pace[1]) >= training_time.MEASURE_STEPS
    step_s = float(pace[2]) / 1e3
    assert f"note: this recipe takes about {pace[3]} on this device, hours, not minutes" in text
    budget = shlex.split(lines[-1].strip())
    assert budget[:3] == ["python", "-m", "primal_dt.train"]
    mine, theirs = (train_config.flat(dataclasses.asdict(train_config.build(a).cfg))
                    for a in (argv, budget[3:]))
    assert {k: v for k, v in mine.items() if k not in SCALED} == {k: v for k, v in theirs.items() if k not in SCALED}
    steps = theirs["steps"]
    assert 0.8 * training_time.BUDGET_S <= steps * step_s <= training_time.BUDGET_S  # fits, at the measured pace
    assert theirs["warmup_steps"] == round(steps / 10) and theirs["checkpoint_every"] == round(steps / 20)
    assert (steps - 1) // theirs["eval.every"] == 9  # as many evaluations as the recipe, at a scaled cadence
    assert "interrupted at step" in out and "nothing to resume" in out  # stopped before any checkpoint


def test_a_recipe_of_hours_on_a_cpu_is_offered_the_datasets_cpu_recipe(hopper_file, tmp_path):
    """Where configs/dt/<env>-cpu.yaml exists, the note offers it (the user's other options kept, the ones it
    sets left to it) instead of a scaled-down paper recipe; a run already on it gets the budget command."""
    argv = args(hopper_file, tmp_path, "steps=100000", "eval.every=10000", "seed=3", "model=dt")
    run = training.prepare(train_config.build(argv))
    c = training_time.Costs(step_s=0.5, act_s={50: 0.01}, targets=2, episode_steps=1000, num_envs=50)
    text = training_time.projection(run, c, 0)
    assert "note: this recipe takes about" in text and "hours, not minutes" in text
    assert "CPU recipe for hopper-medium (configs/dt/hopper-medium-cpu.yaml" in text
    offered = shlex.split(text.splitlines()[-1].strip())
    assert offered[:3] == ["python", "-m", "primal_dt.train"] and "preset=hopper-medium-cpu" in offered
    theirs = train_config.build(offered[3:])
    assert theirs.preset == "hopper-medium-cpu" and theirs.provenance["steps"] == "preset hopper-medium-cpu"
    assert (theirs.cfg.seed, theirs.cfg.model.name, theirs.cfg.threads) == (3, "dt", 1)
    assert theirs.cfg.data_source == f"d4rl:{hopper_file}" and theirs.cfg.model.d_model == 128
    on_it = training.prepare(train_config.build(offered[3:] + ["steps=100000"]))
    assert "preset=hopper-medium-cpu" not in training_time.projection(on_it, c, 0).splitlines()[-1]


def test_a_short_recipe_gets_its_projection_and_no_warning(hopper_file, tmp_path, capsys):
    train_run(args(hopper_file, tmp_path, "steps=40", *QUIET))
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("time on cpu")]
    assert re.search(r"measured over 20 steps: 40 steps x [\d.]+ ms = <?\d+s, validation <?\d+s; about <?\d+s in all", line)
    assert "note:" not in out


def test_projection_and_budget_are_their_formulas(hopper_file, tmp_path):
    run = training.prepare(train_config.build(args(
        hopper_file, tmp_path, "steps=100000", "warmup_steps=10000", "eval.every=10000", "eval.episodes=10",
        "eval.final_episodes=100", "eval.num_envs=20", "eval.max_steps=0", "checkpoint_every=10000")))
    c = training_time.Costs(step_s=0.5, act_s={20: 0.008}, targets=2, episode_steps=1000, num_envs=20,
                            validation_s=0.3)
    start_s, step_20 = training_time.EVAL_START_S, 0.008 + 20 * training_time.SIM_STEP_S
    assert c.rollout_s(10) == pytest.approx(start_s + 1 * 1000 * step_20)  # 20 jobs on 20 simulators: one round
    assert c.rollout_s(100) == pytest.approx(start_s + 10 * 1000 * step_20)  # 200 jobs: ten rounds
    assert c.rollout_s(3) == pytest.approx(start_s + 1000 * (0.008 + 6 * training_time.SIM_STEP_S))  # 6 simulators
    run.step = 25_000  # periodic evaluations still due at 30k, ..., 90k
    assert training_time.remaining_s(run, c) == pytest.approx(75_000 * 0.5 + 7 * (c.rollout_s(10) + 0.3)
                                                              + c.rollout_s(100) + 0.3)
    run.step = 0
    fit = training_time.budget(run, c, budget_s=1800)
    total = fit["steps"] * 0.5 + 9 * (c.rollout_s(10) + 0.3) + c.rollout_s(100) + 0.3
    assert 0.9 * 1800 <= total <= 1800 and fit["steps"] == training_time.nice(fit["steps"])
    assert fit == {"steps": fit["steps"], "warmup_steps": fit["steps"] // 10, "eval.every": fit["steps"] // 10,
                   "checkpoint_every": fit["steps"] // 10}
    slow = training_time.Costs(step_s=0.5, act_s={20: 0.1}, targets=2, episode_steps=1000, num_envs=20)
    fit = training_time.budget(run, slow, budget_s=1800)  # evaluation would take 40 min: it gets half at most
    evals = ((fit["steps"] - 1) // fit["eval.every"] if fit["eval.every"] else 0) * slow.rollout_s(10)
    assert evals + slow.rollout_s(fit["eval.final_episodes"]) <= 900 and fit["eval.final_episodes"] < 100
    assert [training_time.duration(s) for s in (0, 0.3, 45, 245, 42_720)] == ["0s", "<1s", "45s", "4m05s", "11h52m"]


def test_a_run_stopped_before_its_first_step_checkpoint_resumes_from_its_wall_time_one(hopper_file, tmp_path):
    common = args(hopper_file, tmp_path, "steps=150", "log_every=5", "checkpoint_every=1000",
                  "checkpoint_minutes=0.002", "tensorboard=true", *QUIET)  # every 0.12 s, never by steps
    proc = start([*common, f"out={tmp_path / 'stopped'}"])
    runs = tmp_path / "stopped" / "hopper-medium" / "primal+dt"
    deadline = time.time() + 120
    while time.time() < deadline and not list(runs.glob("*/last.pt")) and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    (last,) = runs.glob("*/last.pt")
    step = dt_checkpoint.load(last).step
    assert 0 < step < 150, f"the run was not stopped mid-way (checkpoint at step {step})"
    assert proc.returncode == 130, err[-3000:]
    said = (rf"interrupted by SIGTERM at step \d+; the last good checkpoint {re.escape(str(last))} \(step {step}\) is "
            rf"intact; continue with: python -m primal_dt.train resume={re.escape(str(last.parent))}")
    assert re.search(said, out), out[-2000:]
    resumed = train_run([f"resume={last.parent}", "progress=false", "threads=1"])
    straight = train_run([*common, f"out={tmp_path / 'straight'}"])
    assert resumed["steps"] == straight["steps"] == 150
    a, b = dt_checkpoint.load(resumed["run_dir"]).model, dt_checkpoint.load(straight["run_dir"]).model
    assert all(torch.equal(a[k], b[k]) for k in b)

    def losses(d):
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars("loss/total")]

    assert losses(resumed["run_dir"]) == losses(straight["run_dir"])


def test_the_progress_bar_shows_loss_score_validation_and_time_left(hopper_file, tmp_path, capsys):
    train_run(args(hopper_file, tmp_path, "progress=true", "steps=40", "eval.every=20", "eval.episodes=1",
                   "eval.final_episodes=0", "eval.max_steps=3", "eval.num_envs=1"))
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    last = [x for x in bar if x.startswith("hopper-medium primal+dt: 100%")][-1]
    shown = r"40/40 \[\S+, [\d.]+it/s, loss=\d+\.\d{4}, score=-?\d+\.\d, val_mse=\d+\.\d{4}, eta=<?\d+s\]"
    assert re.search(shown, last), last
    assert math.isfinite(float(re.search(r"loss=(\S+?),", last)[1]))
