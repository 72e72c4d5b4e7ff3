"""Honest long runs (``agents.time_projection``'s clock, ``agents.training``'s checkpoint clock,
``checkpoint_minutes``): the trainer projects its duration from its own measured pace, says plainly when the recipe takes hours here and, on a CPU,
prints the CPU recipe's command; checkpoints come by wall time too (the first after a minute), so a run stopped
before its first step checkpoint resumes exactly; the progress bar shows loss, last score, last
validation MSE and time left, evaluations included at their measured time. Real processes, real
signals, real Hopper data, tiny models."""

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from agents import dt_checkpoint, time_projection, training
from agents import train_config
from primal_dt.train import run as train_run

ROOT = Path(__file__).resolve().parents[2]
TINY = ["preset=smoke", "progress=false", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.s=8",
        "K=5", "batch_size=8", "warmup_steps=5", "threads=1"]
QUIET = ["eval.every=0", "eval.final_episodes=0"]


def args(hopper_file, out, *extra):
    return [*TINY, f"data_source=d4rl:{hopper_file}", f"out={out}", *extra]


def start(argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PRIMAL_DT_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "primal_dt.train", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # Ctrl-C as from a terminal,
                            # even where pytest runs with SIGINT ignored (in a shell's background)


def test_a_recipe_of_hours_on_a_cpu_is_offered_the_cpu_recipe(hopper_file, tmp_path):
    """The note offers recipe=cpu (the user's other options kept, the ones the recipe sets left to it); a run
    already on it is told the hours only."""
    argv = args(hopper_file, tmp_path, "steps=100000", "eval.every=10000", "seed=3", "model=dt")
    run = training.prepare(train_config.build(argv))
    text = time_projection.projection(run.built, run.device, 0.5, 0, 20)
    assert text.startswith("time on cpu, 1 thread, measured over 20 steps: 100,000 steps x 500.0 ms = 13h53m of "
                           "training; evaluations and validations are timed as they run")
    assert ("\nnote: this recipe takes about 13h53m on this device, hours, not minutes. Ctrl-C stops it with a "
            "checkpoint (and prints the resume= command that continues it).") in text
    assert "stop it and run the CPU recipe instead (configs/dt/recipes/cpu.yaml; its time per kind of CPU: " \
           "docs/cpu.md#the-cpu-recipe):" in text
    offered = shlex.split(text.splitlines()[-1].strip())
    assert offered[:3] == ["python", "-m", "primal_dt.train"] and "recipe=cpu" in offered
    assert not any(w.startswith(("steps=", "eval.every=")) for w in offered)  # the recipe's own, left to it
    theirs = train_config.build(offered[3:])
    assert theirs.cfg.recipe == "cpu" and theirs.provenance["steps"] == "recipe cpu"
    assert (theirs.cfg.seed, theirs.cfg.model.name, theirs.cfg.threads) == (3, "dt", 1)
    assert theirs.cfg.data_source == f"d4rl:{hopper_file}" and theirs.cfg.model.d_model == 128
    on_it = training.prepare(train_config.build(offered[3:] + ["steps=100000"]))
    text = time_projection.projection(on_it.built, on_it.device, 0.5, 0, 20)
    assert text.splitlines()[-1] == ("note: this recipe takes about 13h53m on this device, hours, not minutes. "
                                     "Ctrl-C stops it with a checkpoint (and prints the resume= command that "
                                     "continues it).")


def test_a_short_recipe_gets_its_projection_and_no_warning(hopper_file, tmp_path, capsys):
    train_run(args(hopper_file, tmp_path, "steps=40", *QUIET))
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("time on cpu")]
    assert re.search(r"measured over 20 steps: 40 steps x [\d.]+ ms = <?\d+s of training; evaluations", line)
    assert "note:" not in out


def test_the_time_left_is_the_measured_pace_and_the_measured_evaluations(hopper_file, tmp_path):
    run = training.prepare(train_config.build(args(
        hopper_file, tmp_path, "steps=100000", "eval.every=10000", "eval.episodes=10", "eval.final_episodes=100",
        "eval.num_envs=20")))
    clock = time_projection.Clock(run.built, run.device, len(run.info.targets), run.step)
    assert clock.eta(run.step) is None  # nothing is claimed before the pace is measured
    clock.step_s = 0.5
    step = 25_000  # periodic evaluations still due at 30k, ..., 90k, then the final one
    assert clock.eta(step) == time_projection.duration(75_000 * 0.5)  # no evaluation timed yet
    clock.exclude(12.0)  # 10 episodes x 2 targets on 20 simulators: one round; the final 100 x 2: ten rounds
    assert clock.eta(step) == time_projection.duration(75_000 * 0.5 + 12.0 * (7 + 10))
    assert [time_projection.duration(s) for s in (0, 0.3, 45, 245, 42_720)] == ["0s", "<1s", "45s", "4m05s", "11h52m"]


def test_wall_time_checkpoints_start_after_a_minute_and_double_up_to_checkpoint_minutes():
    clock = training.CheckpointClock(10, training.Dist(), torch.device("cpu"))
    gaps = []
    for _ in range(6):
        before = time.monotonic()
        gaps.append(round(clock.deadline - before))
        clock.restart()
    assert gaps == [60, 120, 240, 480, 600, 600]
    assert not clock.due(1)
    clock.deadline = time.monotonic()
    assert clock.due(2)
    off = training.CheckpointClock(0, training.Dist(), torch.device("cpu"))
    off.deadline = 0
    assert not off.due(3)


def test_a_run_stopped_before_its_first_step_checkpoint_resumes_from_its_wall_time_one(hopper_file, tmp_path):
    common = args(hopper_file, tmp_path, "steps=150", "log_every=5", "checkpoint_every=1000",
                  "checkpoint_minutes=0.002", "tensorboard=true", *QUIET)  # every 0.12 s, never by steps
    proc = start([*common, f"out={tmp_path / 'stopped'}"])
    runs = tmp_path / "stopped" / "hopper-medium" / "primal+dt"
    deadline = time.time() + 600  # minutes on a loaded machine; the loop ends as soon as it may
    while time.time() < deadline and not list(runs.glob("*/last.pt")) and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    (last,) = runs.glob("*/last.pt")
    step = dt_checkpoint.load(last).step
    assert 0 < step < 150, f"the run was not stopped mid-way (checkpoint at step {step})"
    assert proc.returncode == 130, err[-3000:]
    # the interrupt writes a checkpoint at the step it reached (unless the wall-time one was written at it)
    said = (rf"interrupted by SIGTERM at step {step}(: checkpoint written at this step \({re.escape(str(last))}\)|; "
            rf"the last good checkpoint {re.escape(str(last))} \(step {step}\) is intact); continue with: "
            rf"python -m primal_dt.train resume={re.escape(str(last.parent))}")
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


def test_the_progress_bar_shows_loss_score_validation_and_time_left(hopper_file, tmp_path, run_cli):
    p = run_cli("primal_dt.train", *args(hopper_file, tmp_path, "progress=true", "steps=40", "eval.every=20",
                                         "eval.episodes=1", "eval.final_episodes=0", "eval.max_steps=3",
                                         "eval.num_envs=1"), terminal=True)
    assert p.returncode == 0, p.stderr[-3000:]
    bar = p.stderr.replace("\r", "\n").splitlines()
    last = [x for x in bar if x.startswith("hopper-medium primal+dt: 100%")][-1]
    shown = r"40/40 \[\S+, +[\d.]+it/s, loss=\d+\.\d{4}, score=-?\d+\.\d, val_mse=\d+\.\d{4}, eta=<?\d+s\]"
    assert re.search(shown, last), last
    assert math.isfinite(float(re.search(r"loss=(\S+?),", last)[1]))


def test_without_a_bar_a_log_gets_plain_progress_lines(hopper_file, tmp_path, capsys, monkeypatch):
    """``eval.sweep`` runs with ``progress=false`` into a log file: the log still says how far the run got."""
    from primal_dt.run.monitor import RunMonitor

    monkeypatch.setattr(RunMonitor, "LINE_EVERY_S", 0.0)
    train_run(args(hopper_file, tmp_path, "steps=30", "eval.every=10", "eval.episodes=1", "eval.final_episodes=0",
                   "eval.max_steps=3", "eval.num_envs=1"))
    captured = capsys.readouterr()
    lines = [x for x in captured.out.splitlines() if x.startswith("step ") and "/30 (" in x]
    assert [x.split()[1] for x in lines] == [f"{n}/30" for n in range(1, 31)]
    assert re.fullmatch(r"step 30/30 \(100%\): loss \d+\.\d{4}, score -?\d+\.\d, val_mse \d+\.\d{4}, eta <?\d+s",
                        lines[-1]), lines[-1]
    assert "\r" not in captured.err + captured.out


def test_output_that_is_not_a_terminal_gets_plain_lines_not_bar_frames(hopper_file, tmp_path, capsys, monkeypatch):
    """A run written to a file or a pipe (here pytest's capture, no terminal) draws no bar even with progress=true:
    training and its evaluation print a plain line at most once a ``LINE_EVERY_S`` (0 here) instead."""
    from primal_dt.run import progress
    from primal_dt.run.monitor import RunMonitor

    monkeypatch.setattr(RunMonitor, "LINE_EVERY_S", 0.0)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    train_run(args(hopper_file, tmp_path, "progress=true", "steps=20", "eval.every=10", "eval.episodes=2",
                   "eval.final_episodes=0", "eval.max_steps=3", "eval.num_envs=1", "eval.targets=3600"))
    captured = capsys.readouterr()
    assert "\r" not in captured.err + captured.out and "it/s" not in captured.err + captured.out
    lines = captured.out.splitlines()
    assert [x.split()[1] for x in lines if re.match(r"step \d+/20 \(", x)] == [f"{n}/20" for n in range(1, 21)]
    assert [x for x in lines if x.startswith("eval at step")] == ["eval at step 10: 1/2 episodes (50%)",
                                                                 "eval at step 10: 2/2 episodes (100%)"]


def test_a_run_shorter_than_the_interval_prints_no_progress_line(hopper_file, tmp_path, capsys):
    train_run(args(hopper_file, tmp_path, "steps=20", *QUIET))
    assert not [x for x in capsys.readouterr().out.splitlines() if re.match(r"step \d+/20 ", x)]
