"""python -m eval.sweep as a user runs it: real training subprocesses on real Hopper data, a second
call that skips finished runs and resumes the ones asked for more, early errors."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents import dt_checkpoint
from eval.sweep import plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ["preset=smoke", "tensorboard=false", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.s=8",
        "K=5", "batch_size=8", "warmup_steps=3", "eval.every=0", "eval.final_episodes=2", "eval.max_steps=15",
        "eval.num_envs=2", "eval.engine=stream"]


def sweep(hopper_file, out, *args, check=True):
    p = subprocess.run([sys.executable, "-m", "eval.sweep", *TINY, f"data_source=d4rl:{hopper_file}", f"out={out}",
                        *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def run_dirs(out):
    return sorted(d for d in Path(out).glob("hopper-medium/*/*-seed*") if d.is_dir())


def test_grid_runs_then_a_second_call_skips_and_resumes(hopper_file, tmp_path):
    out = tmp_path / "sweep"
    p = sweep(hopper_file, out, "model=dt,primal+dt", "seeds=0", "steps=6", "jobs=2")
    assert "2 runs: 2 to start, 0 to resume, 0 finished; 2 at a time" in p.stdout
    first = run_dirs(out)
    assert [d.parent.name for d in first] == ["dt", "primal+dt"]
    assert all((d / "summary.json").exists() for d in first)
    assert "| hopper-medium | D4RL | primal+dt | stream (not trained) | 1 | 6 |" in p.stdout and (out / "report" / "scores.md").exists()
    stamps = {d: (d / "summary.json").stat().st_mtime_ns for d in first}

    p = sweep(hopper_file, out, "model=dt", "seeds=0,1", "steps=6")
    assert "2 runs: 1 to start, 0 to resume, 1 finished" in p.stdout
    assert len(run_dirs(out)) == 3
    assert {d: (d / "summary.json").stat().st_mtime_ns for d in first} == stamps  # finished runs untouched
    assert "| hopper-medium | D4RL | dt | stream (not trained) | 2 | 6 |" in p.stdout

    p = sweep(hopper_file, out, "model=dt", "seeds=0", "steps=9")
    assert "1 runs: 0 to start, 1 to resume, 0 finished" in p.stdout
    dt0 = next(d for d in first if d.parent.name == "dt")
    assert dt_checkpoint.load(dt0).step == 9 and len(run_dirs(out)) == 3  # same directory, continued


@pytest.mark.parametrize("bad,match", [
    (["lrr=0.1"], "run hopper-medium dt seed 0"),
    (["seeds=0,-1"], r"seeds must hold numbers that are in \[0, 4294967296\), got 0, -1"),
    (["model=dt,nonsense"], "unknown model 'nonsense'"),
    (["env=hopper-medium,abc"], "env=abc: unknown dataset name 'abc'"),  # the valid first run never starts
    (["resume=somewhere"], "resume= is per run"),
    (["threads=0"], "threads must be >= 1"),
    (["seeds=0,1,0"], "seeds= names 0 more than once"),
    (["model=dt,primal+dt,dt"], "model= names dt more than once"),
    ([f"report={__file__}"], "is a file; give the directory to write the report into"),
    (["eval.final_episodes=0"], "eval.final_episodes=0: a sweep ends in a report of its runs' final scores"),
])
def test_bad_options_fail_before_any_run_starts(hopper_file, tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        plan([*TINY, f"data_source=d4rl:{hopper_file}", f"out={tmp_path / 'sweep'}", "model=dt", "steps=4", *bad])
    assert not (tmp_path / "sweep").exists()


def test_the_command_says_what_was_wrong_in_one_line(hopper_file, tmp_path):
    p = sweep(hopper_file, tmp_path / "sweep", "model=dt", "steps=4", "lrr=0.1", check=False)
    assert p.returncode == 2 and "--lr" in p.stderr  # tyro's error names the close option
    assert p.stderr.rstrip().splitlines()[-1].startswith("error: run hopper-medium dt seed 0: training does not")
    assert "Traceback" not in p.stderr and not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_a_killed_sweep_resumes_its_run_exactly_where_it_stopped(hopper_file, tmp_path):
    out = tmp_path / "sweep"
    args = [sys.executable, "-m", "eval.sweep", *TINY, f"data_source=d4rl:{hopper_file}", f"out={out}", "model=dt",
            "seeds=0", "steps=400", "checkpoint_every=20"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not list(out.glob("hopper-medium/dt/*/last.pt")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its training process die together
    proc.wait()
    (d,) = run_dirs(out)
    assert not (d / "summary.json").exists()
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 to resume" in p.stdout
    assert run_dirs(out) == [d] and dt_checkpoint.load(d).step == 400 and (d / "summary.json").exists()


def test_the_sweep_reads_its_options_with_the_grammar_of_every_command(capsys, tmp_path):
    from eval.sweep import split_args

    sweep, rest = split_args(["env=hopper-medium,walker2d-medium", "--model", "dt", "primal+dt", "seed=3",
                              "--eval.targets", "3600", "1800", "steps=5", f"out={tmp_path}"])
    assert (sweep.env, sweep.model, sweep.seeds, sweep.out) == (("hopper-medium", "walker2d-medium"),
                                                               ("dt", "primal+dt"), (3,), str(tmp_path))
    assert rest == ["--eval.targets", "3600", "1800", "--steps=5"]  # handed to each run
    with pytest.raises(SystemExit) as exit_:
        split_args(["seeds=0,x"])
    assert exit_.value.code == 2 and "--seeds" in capsys.readouterr().err


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped has ended)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.slow
def test_one_sweep_per_out_and_its_runs_die_with_it(hopper_file, tmp_path):
    """A second sweep on the same ``out`` starts nothing and names the first's pid; a SIGKILL of the
    sweep alone (not its process group) ends its training run too, and the next call resumes that run,
    the only one."""
    out = tmp_path / "sweep"
    args = [sys.executable, "-m", "eval.sweep", *TINY, f"data_source=d4rl:{hopper_file}", f"out={out}", "model=dt",
            "seeds=0", "checkpoint_every=10"]
    first = subprocess.Popen([*args, "steps=100000"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not list(out.glob("hopper-medium/dt/*/last.pt")):
            time.sleep(0.2)
        (d,) = run_dirs(out)
        trainer = int((d / ".lock").read_text())
        assert alive(trainer) and trainer != first.pid
        second = subprocess.run([*args, "steps=100000"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2 and "Traceback" not in second.stderr  # the package's own refusal
        assert f"error: the sweep's output {out.resolve()} is in use by process {first.pid}" in second.stderr
        assert "[sweep]" not in second.stdout and run_dirs(out) == [d]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    deadline = time.time() + 60
    while time.time() < deadline and alive(trainer):
        time.sleep(0.1)
    assert not alive(trainer), "the sweep's training run outlived it"
    step = dt_checkpoint.load(d).step
    p = subprocess.run([*args, f"steps={step + 2}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 to resume" in p.stdout and run_dirs(out) == [d] and dt_checkpoint.load(d).step == step + 2


def test_a_sweep_into_an_out_whose_lock_is_a_planted_link_leaves_its_target_untouched(hopper_file, tmp_path,
                                                                                      one_line_error):
    out, victim = tmp_path / "sweep", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious\n")
    (out / ".lock").symlink_to(victim)
    p = sweep(hopper_file, out, "model=dt", "steps=4", check=False)
    one_line_error(p, f"the lock file of the sweep's output, {out.resolve() / '.lock'}, is a symbolic link",
                   f"remove {out.resolve() / '.lock'}")
    assert victim.read_text() == "precious\n" and run_dirs(out) == []


def test_logs_that_cannot_be_written_are_one_line_before_any_run(hopper_file, tmp_path, one_line_error):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep-logs").write_text("a file in the way")
    p = sweep(hopper_file, out, "model=dt", "steps=4", check=False)
    one_line_error(p, f"could not write the directory of the runs' logs (nothing was started) {out / 'sweep-logs'}: "
                      "a file is in the way of a directory", status=1)
    assert run_dirs(out) == []
