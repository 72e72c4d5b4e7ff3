"""Run a grid of training runs (datasets x models x seeds) and report them as a table.

    python -m eval.sweep env=hopper-medium,walker2d-medium model=dt,primal+dt seeds=0,1,2 steps=4000

The options are training's, in the same grammar; ``env``, ``model`` and ``seeds`` take lists and span the
grid, every other option goes to each run as given. A model may carry options of its own after ``:``, e.g.
``model=dt,primal+dt,bc:data_top_fraction=0.1`` adds filtered behaviour cloning as a row of its own. One
sweep at a time holds ``out``, and its runs die with it however it ends (Ctrl-C, ``kill``, a SIGKILL of the
sweep alone), so no run trains on beside the next call. Calling again is cheap and safe: a run whose directory (``<out>/<env>/<model>/*-seed<k>``, same
configuration) holds a finished run of at least the asked steps is skipped, one killed or asked for fewer
steps is resumed (exactly), the rest start. At the end the finished runs go through ``eval.report``. A sweep
writes only inside ``out``: a symbolic link found there (a run directory, a folder of runs, a log, the report's
folder) is refused before any run starts, never followed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agents import dt_checkpoint
from primal_dt.run import cli, errors, lock, options, outputs, runtime
from agents import train_config

from . import report as report_mod


@dataclass
class Job:
    env: str
    model: str
    seed: int
    argv: list[str]
    label: str
    steps: int
    action: str = "start"  # start | resume | skip
    run_dir: Path | None = None

    @property
    def name(self) -> str:
        return f"{self.env} {self.label} seed {self.seed}"

    def command(self, threads: int) -> list[str]:
        run = [f"resume={self.run_dir}", f"steps={self.steps}"] if self.action == "resume" else self.argv
        return [sys.executable, "-m", "primal_dt.train", *run, f"threads={threads}", "progress=false"]


@dataclass
class SweepConfig:
    """The sweep's own options: the grid's axes and how its runs are launched."""

    env: tuple[str, ...] = ()
    """datasets of the grid (empty: training's default env)"""
    model: tuple[str, ...] = ()
    """models of the grid, as training's model=, each with options of its own after ':' (bc:data_top_fraction=0.1)
    (empty: training's default)"""
    seeds: tuple[int, ...] = (0,)
    """seeds of the grid"""
    out: str = "runs/sweep"
    """root of the runs (<out>/<env>/<model>/<time>-seed<k>)"""
    jobs: int = 0
    """runs at once (0: as many as fit the cores at threads each)"""
    threads: int = 1
    """torch threads per run"""
    report: str = ""
    """where the report goes ('' : <out>/report)"""


WHO = "a sweep"
ALIASES = {"attention": "model", "model.name": "model", "seed": "seeds"}
"""training's spellings of the axes (``attention=linear``, ``seed=3``) name the same axis"""
PROG = "python -m eval.sweep"
DESCRIPTION = (__doc__.split("\n\n")[0] + " Every other option is each run's: training's (python -m primal_dt.train "
               "--help).")


def split_args(argv: list[str]) -> tuple[SweepConfig, list[str]]:
    """(sweep options, options passed to every run), the sweep's options checked."""
    sweep, rest = cli.parse(SweepConfig, argv, prog=PROG, description=DESCRIPTION, shorthands=ALIASES, known=True)
    if "resume" in cli.given(train_config.TrainConfig, rest):
        raise ValueError("resume= is per run; a sweep resumes its killed runs by itself when called again")
    for key in ("env", "model", "seeds"):
        values = getattr(sweep, key)
        if not values and key in cli.given(SweepConfig, argv, ALIASES):
            raise ValueError(f"{key}= needs at least one value")
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:  # the same run twice: trained twice beside itself, then reported as two seeds
            raise ValueError(f"{key}= names {', '.join(twice)} more than once; give each value once")
    if sweep.report and Path(sweep.report).exists() and not Path(sweep.report).is_dir():  # found after the runs
        raise ValueError(f"report={sweep.report} is a file; give the directory to write the report into")
    options.check_numbers(sweep, {"seeds": options.SEED, "jobs": options.AT_LEAST_0, "threads": options.AT_LEAST_1})
    options.check_output_dir(sweep.out)
    return sweep, rest


def plan(argv: list[str]) -> tuple[SweepConfig, list[Job]]:
    """Every run of the grid, its options checked before any starts, and whether it starts, resumes or is done."""
    import envs

    sweep, rest = split_args(argv)
    out = Path(sweep.out)
    jobs = []
    for env in sweep.env or (train_config.TrainConfig().env,):
        try:  # a dataset name the package does not know fails here, not after the runs before it
            envs.get_spec(env)
        except (KeyError, ValueError) as err:
            raise ValueError(f"env={env}: {err.args[0] if err.args else err}") from err
        for model in sweep.model or (train_config.TrainConfig().model.name,):
            name, *own = model.split(":")  # the model's own options, after the common ones: they win
            for seed in sweep.seeds:
                run_argv = [f"env={env}", f"model={name}", f"seed={seed}", *rest, *own, f"out={out}"]
                try:
                    built = train_config.build(run_argv)
                    train_config.check(built.cfg)
                    runtime.pick_device(built.cfg.device)  # CUDA absent or a missing index: before any run
                except ValueError as err:
                    raise ValueError(f"run {env} {model} seed {seed}: {err}") from err
                except SystemExit as err:  # the option parser has printed what it could not read
                    raise ValueError(f"run {env} {model} seed {seed}: training does not accept the options shown "
                                     "above (python -m primal_dt.train --help lists them)") from err
                if built.cfg.eval.final_episodes == 0:  # else every run trains, and the report has nothing to show
                    raise ValueError("eval.final_episodes=0: a sweep ends in a report of its runs' final scores, so "
                                     "each run needs a final evaluation; give eval.final_episodes >= 1 (or train the "
                                     "runs with python -m primal_dt.train)")
                job = Job(env, model, seed, run_argv, train_config.model_label(built.cfg), built.cfg.steps)
                same = next((j for j in jobs if (j.env, j.label, j.seed) == (env, job.label, seed)), None)
                if same is not None:  # one run directory for both
                    raise ValueError(f"model={same.model} and model={model} are the same run ({job.label}); give "
                                     "each once")
                _match_existing(job, built.cfg, out)
                jobs.append(job)
    return sweep, jobs


def _fixed(cfg: dict) -> dict:
    """What identifies a run of the grid: the options a resume cannot change, by value (lists as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in train_config.flat(cfg).items()
            if k.split(".")[0] not in train_config.RESUMABLE and k not in ("out", "preset", "recipe")}


def _match_existing(job: Job, cfg, out: Path) -> None:
    want = _fixed(dataclasses.asdict(cfg))
    runs = out / job.env / job.label
    outputs.no_links(out, runs, WHO)  # new runs are made in it
    for d in sorted(runs.glob(f"*-seed{job.seed}"), reverse=True):
        outputs.no_links(out, d, WHO)  # resumed, a linked run would be overwritten where it lives
        if not (d / dt_checkpoint.FILENAME).exists():
            continue
        try:  # through the config's reader, so options added since the run was written take their defaults
            ck = dt_checkpoint.load(d)
            saved = dataclasses.asdict(train_config.from_dict(ck.config))
        except (ValueError, FileNotFoundError) as err:
            print(f"[sweep] {d} is not resumed: {err}", file=sys.stderr, flush=True)
            continue
        if _fixed(saved) != want:
            continue
        job.run_dir = d
        job.action = "skip" if (d / "summary.json").exists() and ck.step >= job.steps else "resume"
        return


def _die_with(parent: int):
    """For ``Popen(preexec_fn=...)``: the child gets SIGTERM (training's clean interrupt) when ``parent`` dies,
    by SIGKILL too (Linux's ``PR_SET_PDEATHSIG``). Elsewhere nothing: the held ``out`` keeps a second sweep off."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec():
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def log_of(logs: Path, job: Job) -> Path:
    return logs / f"{job.env}-{job.label}-seed{job.seed}.log"


def execute(jobs: list[Job], parallel: int, threads: int, logs: Path, held: int) -> list[Job]:
    """Run the jobs as local processes, ``parallel`` at a time; returns those that failed. ``held``: the
    lock of ``out`` (``lock.hold``), handed to each run so ``out`` stays held while any of them lives."""
    todo = [j for j in jobs if j.action != "skip"]
    with errors.writing(logs, "directory of the runs' logs (nothing was started)"):
        logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    running: list[tuple[Job, subprocess.Popen, float, object]] = []
    failed, finished = [], 0
    t_start = time.time()
    try:
        while todo or running:
            while todo and len(running) < parallel:
                j = todo.pop(0)
                log = log_of(logs, j)
                fh = outputs.open_append(log, f"log of {j.name} (it was not started)")
                p = subprocess.Popen(j.command(threads), stdout=fh, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with(os.getpid()), pass_fds=(held,))
                print(f"[sweep] {j.action} {j.name} (log {log})", flush=True)
                running.append((j, p, time.time(), fh))
            time.sleep(1.0)
            for item in list(running):
                j, p, t0, fh = item
                if p.poll() is None:
                    continue
                running.remove(item)
                fh.close()
                finished += 1
                state = "done" if p.returncode == 0 else f"FAILED (exit {p.returncode}, see {log_of(logs, j)})"
                if p.returncode != 0:
                    failed.append(j)
                left = len(todo) + len(running)
                print(f"[sweep] {state}: {j.name} in {(time.time() - t0) / 60:.1f} min; {finished} finished, "
                      f"{left} to go, {(time.time() - t_start) / 60:.1f} min so far", flush=True)
    except KeyboardInterrupt:
        for _, p, _, _ in running:
            p.terminate()
        for _, p, _, _ in running:
            p.wait()
        print("[sweep] interrupted; call the same command again to resume the killed runs", flush=True)
        raise
    return failed


def run(argv: list[str]) -> dict:
    out = Path(plan(argv)[0].out)  # every option checked before anything is written
    held = lock.hold(out, "sweep's output")  # then planned again under the lock: no two sweeps plan the same runs
    try:
        sweep, jobs = plan(argv)
        threads, cores = sweep.threads, runtime.usable_cores()
        parallel = sweep.jobs or max(1, cores // threads)
        counts = {a: sum(j.action == a for j in jobs) for a in ("start", "resume", "skip")}
        print(f"[sweep] {len(jobs)} runs: {counts['start']} to start, {counts['resume']} to resume, "
              f"{counts['skip']} finished; {parallel} at a time x {threads} thread(s) ({cores} cores); out {out}",
              flush=True)
        logs = out / "sweep-logs"
        written = [log_of(logs, j) for j in jobs if j.action != "skip"] + ([] if sweep.report else [out / "report"])
        for path in written:
            outputs.no_links(out, path, WHO)  # before any run starts
        failed = execute(jobs, parallel, threads, logs, held)
        _, jobs = plan(argv)  # where each run now lives (new runs named their directories themselves)
        finished_dirs = [str(j.run_dir) for j in jobs if j.action == "skip"]
        result = {"jobs": jobs, "failed": failed}
        if finished_dirs:
            result["report"] = report_mod.report(finished_dirs, sweep.report or out / "report")
            print(Path(result["report"]["markdown"]).read_text(), flush=True)
    finally:
        lock.release(out)
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed: {', '.join(j.name for j in failed)}; see {out / 'sweep-logs'}")
    return result


def main(argv: list[str] | None = None) -> None:
    def checked(argv: list[str]) -> dict:
        with errors.setup_errors():  # a ValueError or FileNotFoundError of a sweep is a mistake in its input
            return run(argv)

    errors.main(checked, argv, expected=(RuntimeError,))  # runs that failed: one line, status 1


if __name__ == "__main__":
    main()
