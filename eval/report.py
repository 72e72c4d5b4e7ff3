"""Turn training runs into the comparison a paper reports: score tables over seeds and plots.

    python -m eval.report runs/hopper-medium                    # every finished run below it
    python -m eval.report 'runs/*/dt/*' 'runs/*/primal+dt/*' out=report

Each argument is a run directory, a directory of runs (searched recursively), or a glob of either; a run
counts once training finished (``summary.json``), unfinished ones are listed and left out. Runs are averaged
over seeds only when dataset, model, data and every option but the run-time ones (seed, paths, threads,
device, logging, how often and by which engine it evaluated) agree, so a table never averages a 4k-step run
with a 100k-step one; same-model groups kept apart are told
apart by what differs. Each engine that scored a final checkpoint (the run's own evaluation, every
``eval.rollout`` report beside it) is a row of its own, saying whether it is the trained policy.

Per return-to-go target, ``out`` receives ``scores.md`` / ``scores-target<T>.csv`` (per group: CORL's "last"
and "best" normalized score, mean and 95 % interval over seeds (Student's t); the paper's number, marked when
the row's data is not D4RL's; the held-out action MSE; the data's own episodes' level), ``curves.png``
(score during training, 95 % band) and ``scores.png`` (a bar per group, the paper's value marked).

``out/runs.json`` keeps every reported run's scores, curve and config, and is itself an argument: the
report is made again, or grown by new runs, where the run directories (and their checkpoints) are gone.
A run found both there and as a directory is the directory's.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import glob
import io
import json
import math
import re
import shlex
import statistics
import warnings
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import tyro

import envs
from agents import dt_checkpoint, train_config
from agents.stream_training import fidelity
from agents.run_summary import finite_number, read_summary
from envs import sources
from primal_dt.run import checkpoint as ck_io
from primal_dt.run import cli, errors, json_reader, options, presets
from primal_dt.run.monitor import save_figure

from .bench.timing import cell, table

# Options that do not change what a run learns; ``data_source`` is where the data was looked for (a path
# differs between machines): the data found keys the group instead.
RUNTIME_OPTIONS = {"seed", "out", "resume", "threads", "device", "progress", "tensorboard", "checkpoint_every",
                   "checkpoint_minutes", "log_every", "preset", "eval.every", "eval.episodes", "eval.num_envs",
                   "data_source", "eval.engine", "print_config", "ema_decay"}

# Student's t quantile t_{0.975, df} for df = 1..30; beyond, the normal 1.96 is within 2 %.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


@dataclass
class Run:
    path: Path
    env: str
    model: str
    seed: int
    steps: int
    config: dict
    final: dict  # target tag -> {"normalized_mean": ...}
    curves: dict  # target tag -> [(step, normalized score), ...], the final evaluation last
    data: str = "unknown"
    val_mse: float | None = None  # None: the run held nothing out
    data_level: float | None = None
    engine: str = "recompute"  # ``engine_label`` of what measured ``final``
    s_per_1k: float | None = None  # seconds per 1,000 optimisation steps of its training (summary.json); None: unknown
    wall_s: float | None = None  # the training's wall time, evaluations included (``wall_seconds``); None: unknown


@dataclass
class Group:
    env: str
    model: str
    data: str
    key: tuple
    runs: list = field(default_factory=list)
    engine: str = "recompute"


def find_runs(patterns: list[str]) -> tuple[list[Path], list[Path]]:
    """(finished run directories, unfinished ones) under the given paths / globs."""
    found = {}  # run directories in the order found, each once
    for pat in patterns:
        for m in [Path(p) for p in sorted(glob.glob(pat))] or [Path(pat)]:
            if not m.exists():
                raise ValueError(f"{pat}: no such file or directory (give run directories, their parents, or globs)")
            base = m.parent if m.is_file() else m
            found.update(dict.fromkeys(sorted({p.parent for name in ("last.pt", "summary.json")
                                               for p in base.rglob(name)})))
    finished = [d for d in found if (d / "summary.json").exists()]
    return finished, [d for d in found if d not in finished]


@functools.lru_cache(maxsize=None)
def data_level(env: str, source: str) -> float | None:
    """The mean normalized return of the episodes a run trained on, the level a Decision Transformer must
    beat to have learned more than to imitate; None when that data is not readable here."""
    if "+" in source or sources.label(source) == "unknown":
        return None
    try:
        with warnings.catch_warnings():  # the report marks replica data itself
            warnings.simplefilter("ignore", envs.ReplicaWarning)
            ds = envs.load_dataset(env, source=source, verbose=False, download=False, clip_actions=True)
    except (envs.DatasetError, OSError, ValueError, KeyError):
        return None
    return statistics.fmean(envs.normalized_score(env, float(r)) for r in ds.returns)


def engine_label(f) -> str:
    """``recompute``, ``stream (exact, window W)``, ``(exact, from start)`` or ``(exact, whole episodes)`` when the stream is the
    policy the checkpoint was trained as, ``stream (not trained)`` when it is not
    (``agents.stream_training.Fidelity``): never averaged with the others, nor are two windows."""
    if f.engine == "recompute":
        return f.engine
    if not f.exact:
        return f"{f.engine} (not trained)"
    if f.whole_episodes:
        return f"{f.engine} (exact, whole episodes)"
    return f"{f.engine} (exact, from start)" if f.from_start else f"{f.engine} (exact, window {f.stream_window})"


COSINE = ", lr cosine to "
"""what an engine label holds when the run's learning rate fell to the end (``lr_schedule=cosine``)"""
TAILS = ", segment tails"
"""what an engine label holds when a stream_window run counted its segments' tails (``stream_counts=tail``, the
first tables' training: an episode's first steps counted less often than the papers' protocol counts them)"""


def training_label(config: dict) -> str:
    """What sets a run's training apart from its engine's usual one, as a suffix of its engine label: ``, segment
    tails`` for a stream_window run that counted them (``stream_counts``; a config from before the option:
    ``train_config.from_dict``), ``, lr cosine to 0.1`` for a rate that fell along a cosine (``lr_schedule``).
    Each is a training of its own, set beside the protocol's rows (``against_protocol``), not averaged with them."""
    label = ""
    if config.get("stream_window") and config.get("stream_counts", "tail") == "tail":
        label += TAILS
    if config.get("lr_schedule") == "cosine":
        label += f"{COSINE}{config.get('lr_min', 0.1):g}"
    return label


def rollout_runs(run: Run) -> tuple[list[Run], list[str]]:
    """The rollout reports of ``run``'s final checkpoint, each as a run scored by its engine (and capped at its
    own ``max_steps``), and a note for each report left out. One report per engine: evaluations of one checkpoint
    are not seeds, so a second one is left out rather than averaged with the first as if it were another run."""
    out, kept, notes = [], {}, []
    digest = functools.cache(lambda: ck_io.sha256_file(dt_checkpoint.resolve(run.path)))
    # newest first: the report that stands for its engine is the latest one written
    for p in sorted(run.path.glob("rollout-*.json"), key=lambda p: (-_mtime(p), p.name)):
        try:
            rep = json_reader.read(p, nonfinite=True)  # NaN scores are flagged (nonfinite), not averaged
            engine, targets, cap = rep["engine"], rep["targets"], rep["max_steps"]
            if engine not in train_config.ENGINES or not isinstance(targets, dict):
                raise ValueError("no engine or targets")
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
                raise ValueError(f"max_steps {cap!r} is not an integer >= 0")
            if rep.get("train_step") != run.steps:
                notes.append(f"{p}: not the final checkpoint's evaluation, left out")
                continue
            # (a report written before rollouts recorded the checkpoint's digest is matched by its step alone)
            if "checkpoint_sha256" in rep and rep["checkpoint_sha256"] != digest():
                notes.append(f"{p}: an evaluation of another checkpoint (its checkpoint_sha256 is not this run's), "
                             "left out")
                continue
            final = {f"target{t}": {"normalized_mean": float(r["normalized_mean"]),
                                    "episodes": int(rep["episodes_per_target"])} for t, r in targets.items()}
            if not all(finite_number(k.removeprefix("target")) for k in final):
                raise ValueError("a target is not a number")
        except (OSError, ValueError, KeyError, TypeError) as err:
            notes.append(f"{p}: not a rollout report eval.report reads ({err}), left out")
            continue
        label = engine_label(fidelity(engine, run.config)) + training_label(run.config)
        if rep.get("weights") == "ema":  # the same training's other policy (ema_decay): a row of its own
            label += f", EMA {run.config.get('ema_decay', 0):g}"
        if label == run.engine:
            notes.append(f"{p}: the run's own final evaluation is by this engine, left out")
            continue
        if label in kept:
            notes.append(f"{p}: an earlier evaluation by {label} of the final checkpoint than {kept[label]}, left out "
                         "(evaluations of one run are not seeds)")
            continue
        kept[label] = p
        config = {**run.config, "eval": {**(run.config.get("eval") or {}), "max_steps": cap}}
        out.append(dataclasses.replace(run, final=final, curves={}, engine=label, config=config))
    return out, notes


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:  # gone meanwhile: its reading says so
        return 0.0


ARCHIVE_FORMAT = "primal-dt eval.report runs"


def archive(runs: list[Run]) -> str:
    """``runs.json``: what the tables and curves are made from, one record per reported run."""
    return json.dumps({"format": ARCHIVE_FORMAT, "version": 1, "runs": [
        {**dataclasses.asdict(r), "path": str(r.path)} for r in runs]}, indent=1)


def archived_runs(path: Path) -> list[Run]:
    """The runs in a report's ``runs.json``; a ValueError naming the file and the record that is wrong."""
    doc = json_reader.read(path, nonfinite=True)
    if not isinstance(doc, dict) or doc.get("format") != ARCHIVE_FORMAT or not isinstance(doc.get("runs"), list):
        raise ValueError(f"{path}: not a runs.json that eval.report wrote (no format {ARCHIVE_FORMAT!r} "
                         "with a list of runs)")
    out = []
    for i, rec in enumerate(doc["runs"]):
        try:
            final = {str(t): {"normalized_mean": float(v["normalized_mean"]),
                              **({"episodes": int(v["episodes"])} if "episodes" in v else {})}
                     for t, v in rec["final"].items()}
            if not final or not all(t.startswith("target") and finite_number(t.removeprefix("target")) for t in final):
                raise ValueError(f"final scores {list(final)} are not per target")
            optional = {k: None if rec[k] is None else float(rec[k]) for k in ("val_mse", "data_level")}
            for k in ("s_per_1k", "wall_s"):  # (added later)
                optional[k] = None if rec.get(k) is None else float(rec[k])
            config = dataclasses.asdict(train_config.from_dict(rec["config"]))
            engine = str(rec["engine"])
            if TAILS in training_label(config) and TAILS not in engine:  # archived before runs were told apart so
                engine = engine.replace(f"window {config['stream_window']})", f"window {config['stream_window']}){TAILS}", 1)
            out.append(Run(Path(str(rec["path"])), str(rec["env"]), str(rec["model"]), int(rec["seed"]),
                           int(rec["steps"]), config, final,
                           {str(t): [(int(s), float(v)) for s, v in pts] for t, pts in rec["curves"].items()},
                           str(rec["data"]), engine=engine, **optional))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{path}: run {i} cannot be read ({type(err).__name__}: {err}); this file is made by "
                             "eval.report: make it again from the run directories") from None
    return out


def wall_seconds(run_dir: Path) -> float | None:
    """A run's wall time, its evaluations during and after training included: for each process that trained it (a
    resumed run has several), from the second its TensorBoard writer was created (in the event file's name,
    ``events.out.tfevents.<second>.<host>.<pid>.<n>``) to the last write of that process's event files, summed.
    None without event files (tensorboard=false). Each run's machine and load are its own, as for its step cost."""
    spans: list[list] = []  # [host and pid, first second, last write]
    files = []
    for p in run_dir.glob("events.out.tfevents.*"):
        f = p.name.split(".")
        if len(f) >= 7 and f[3].isdigit():
            try:
                files.append((int(f[3]), tuple(f[4:-1]), p.stat().st_mtime))
            except OSError:  # gone meanwhile
                continue
    for start, who, end in sorted(files):
        same = next((s for s in spans if s[0] == who and start <= s[2] + 1), None)  # a process's later file
        if same is None:
            spans.append([who, start, end])
        else:
            same[2] = max(same[2], end)
    return sum(max(end - start, 0.0) for _, start, end in spans) if spans else None


def load_run(d: Path) -> Run:
    """The run in ``d``; a ValueError naming the file and what is wrong with it."""
    summary = read_summary(d / "summary.json")
    if not summary.get("final"):
        raise ValueError(f"{d}: the run finished without a final evaluation (eval.final_episodes=0); "
                         "nothing to report")
    ck = dt_checkpoint.load(d)
    if ck.step != summary["steps"]:  # a summary is the final checkpoint's only until the run is resumed
        raise ValueError(f"{d}: its checkpoint is at step {ck.step} but its summary.json at step {summary['steps']}: "
                         "the run was resumed after it finished and has not finished again; resume it to its end "
                         f"(python -m primal_dt.train resume={d}), then report it")
    history = ck.training.history if ck.training else {}
    curves = {tag.rsplit("/", 1)[1]: sorted((int(s), float(v)) for s, v in pts if math.isfinite(v))
              for tag, pts in history.items() if tag.startswith("eval/normalized/")}
    for tag, r in summary["final"].items():  # the final evaluation ends each curve
        pts = [p for p in curves.get(tag, []) if p[0] < summary["steps"]]
        end = [(summary["steps"], float(r["normalized_mean"]))] if math.isfinite(r["normalized_mean"]) else []
        curves[tag] = pts + end
    try:  # through the config's reader: options added since the run was written take their defaults
        config = dataclasses.asdict(train_config.from_dict(ck.config))
    except ValueError as err:
        raise ValueError(f"{ck.origin}: its run config cannot be read ({err})") from err
    val = (summary.get("validation") or {}).get("action_mse")
    cost = summary.get("s_per_1k_steps")
    f = fidelity(str(summary.get("engine") or (config.get("eval") or {}).get("engine", "recompute")), config)
    return Run(d, summary["env"], summary["model"], int(summary["seed"]), int(summary["steps"]), config,
               summary["final"], curves, sources.label(str(summary.get("data_source") or "")),
               None if val is None else float(val),
               data_level(summary["env"], str(summary.get("data_source") or "")), engine_label(f) + training_label(config),
               float(cost) if presets.fits(cost, float) and math.isfinite(cost) and cost >= 0 else None, wall_seconds(d))


def group_runs(runs: list[Run]) -> tuple[list[Group], list[str]]:
    """Groups of runs to average over seeds, and notes on same-model groups kept apart."""
    groups: dict[tuple, Group] = {}
    for r in runs:
        cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in train_config.flat(r.config).items()
               if k not in RUNTIME_OPTIONS}
        key = (r.env, r.model, tuple(sorted((k, str(v)) for k, v in cfg.items())), r.data, r.engine)
        groups.setdefault(key, Group(r.env, r.model, r.data, key, engine=r.engine)).runs.append(r)
    notes = []
    by_pair = defaultdict(list)
    for g in groups.values():
        by_pair[(g.env, g.model, g.engine)].append(g)
    for (env, model, _), gs in by_pair.items():
        if len(gs) > 1:
            keys = [dict(g.key[2]) | {"data": g.data} for g in gs]
            differ = sorted(k for k in set().union(*keys) if len({kk.get(k) for kk in keys}) > 1)
            notes.append(f"{env} {model}: {len(gs)} groups not averaged together; they differ in "
                         + ", ".join(f"{k} ({' vs '.join(sorted({str(kk.get(k)) for kk in keys}))})" for k in differ))
            for g, k in zip(gs, keys):  # name each group by what sets it apart
                g.model = f"{model} ({', '.join(f'{d}={k.get(d)}' for d in differ)})"
    # a precision other than float32 changes scores (docs/results/gpu-h200-recipe-bf16.md): said, when no label does
    notes += dict.fromkeys(f"{g.env} {g.model}: trained in bf16 autocast (amp=bf16), not float32"  # once per model
                           for g in groups.values() if dict(g.key[2]).get("amp") == "bf16" and "amp=" not in g.model)
    return sorted(groups.values(), key=lambda g: (g.env, g.model, g.engine)), notes


def paper_scores(env: str) -> dict:
    """model -> the paper's normalized score, from the dataset preset's ``paper:`` mapping (a Minari id's:
    its D4RL task's)."""
    try:
        spec = envs.get_spec(env)
        return dict(presets.load_preset("dt", f"{spec.family}-{spec.level}").get("paper") or {})
    except (KeyError, ValueError):
        return {}


def stats(values: list[float]) -> dict:
    """Mean, standard deviation, half-width of the 95 % interval (Student's t), count."""
    n = len(values)
    if not n:
        return {"mean": None, "std": None, "ci95": None, "n": 0}
    std = statistics.stdev(values) if n > 1 else 0.0
    t = _T975[n - 2] if n - 1 <= len(_T975) else 1.96
    return {"mean": statistics.fmean(values), "std": std, "n": n,
            "ci95": t * std / math.sqrt(n) if n > 1 else float("nan")}


def _joined(values) -> str:
    return "/".join(str(x) for x in sorted(set(values)))


def score_rows(groups: list[Group], target: str) -> list[dict]:
    """One row per group with a finite score for ``target``; NaN and inf are left out of the averages
    (``nonfinite`` flags them)."""
    rows = []
    for g in groups:
        runs = [r for r in g.runs if target in r.final]
        vals = [r.final[target]["normalized_mean"] for r in runs]
        if not any(map(math.isfinite, vals)):
            continue
        s = stats([v for v in vals if math.isfinite(v)])
        b = stats([max(v for _, v in c) for c in (r.curves.get(target) for r in runs) if c])  # rollouts: no curve
        v = stats([r.val_mse for r in runs if r.val_mse is not None and math.isfinite(r.val_mse)])
        levels = [r.data_level for r in g.runs if r.data_level is not None]
        costs = [r.s_per_1k for r in g.runs if r.s_per_1k is not None]
        walls = [r.wall_s for r in g.runs if r.wall_s is not None]
        rows.append({"dataset": g.env, "data": g.data, "model": g.model, "engine": g.engine, "seeds": s["n"],
                     "steps": _joined(r.steps for r in g.runs),
                     "episodes": _joined(r.final[target].get("episodes", "?") for r in runs),
                     "eval_episodes": _joined((r.config.get("eval") or {}).get("episodes", "?") for r in runs),
                     "mean": s["mean"], "std": s["std"], "ci95": s["ci95"],
                     "best": b["mean"], "best_std": b["std"], "best_ci95": b["ci95"],
                     "paper": paper_scores(g.env).get(g.model.split(" (")[0]),
                     "data_level": statistics.fmean(levels) if levels else None,
                     "val_mse": v["mean"], "val_mse_std": v["std"], "val_mse_ci95": v["ci95"], "val_seeds": v["n"],
                     "s_per_1k": statistics.median(costs) if costs else None,
                     "min_per_run": statistics.median(walls) / 60 if walls else None,
                     "runs": [str(r.path) for r in g.runs],
                     "per_run": {str(r.path): v for r, v in zip(runs, vals) if math.isfinite(v)}})
    return rows


def _fmt(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def val_cell(r: dict) -> str:
    """``0.0412 +- 0.0031 (2 of 3 seeds)``; significant digits, since an MSE's scale depends on the dataset."""
    if not r["val_seeds"]:
        return ""
    cell = f"{r['val_mse']:.3g}" + (f" +- {r['val_mse_ci95']:.2g}" if r["val_seeds"] > 1 else "")
    return cell + (f" ({r['val_seeds']} of {r['seeds']} seeds)" if r["val_seeds"] < r["seeds"] else "")


def score_cell(mean: float, ci95: float, seeds: int) -> str:
    return f"{_fmt(mean)} +- {_fmt(ci95)}" if seeds > 1 else f"{_fmt(mean)} (1 seed)"


def paper_cell(r: dict) -> str:
    """The paper's number, saying it is on D4RL data when the row's is not (never read as a reproduction)."""
    return _fmt(r["paper"]) + ("" if r["paper"] is None or r["data"] == "D4RL" else f" (on D4RL data, not {r['data']})")


def markdown(rows: list[dict], target: str) -> str:
    return "\n".join([
        f"### Normalized score, target {target.removeprefix('target')}", "",
        "final: the last evaluation; best: each run's best evaluation during training (final included); both mean "
        "+- 95% CI over seeds. episodes: in the final evaluation / in each one during training. data episodes: the "
        "mean normalized return of the episodes trained on.", "",
        "engine: what measured the final score; stream (not trained) is a policy training never optimised "
        "(docs/evaluation.md, stream-exact training).", "",
        "s / 1k steps: the training's seconds per 1,000 optimisation steps, median over its runs (summary.json's "
        "s_per_1k_steps). min / run: the training's wall time, its evaluations included, median over its runs "
        "(TensorBoard's event files: eval.report.wall_seconds). Each run's machine and load are its own, and a run "
        "whose process was paused counts the pause: the median keeps one such run from moving the cell.", "",
        *table(["dataset", "data", "model", "engine", "seeds", "steps", "episodes", "final", "best", "data episodes",
                "paper", "val action MSE", "s / 1k steps", "min / run"],
               [[r["dataset"], r["data"], r["model"], r["engine"], r["seeds"], r["steps"],
                 f"{r['episodes']} / {r['eval_episodes']}", score_cell(r["mean"], r["ci95"], r["seeds"]),
                 "" if r["best"] is None else score_cell(r["best"], r["best_ci95"], r["seeds"]),
                 _fmt(r["data_level"]), paper_cell(r), val_cell(r), _fmt(r["s_per_1k"]), _fmt(r["min_per_run"])]
                for r in rows])])


def same_runs(base: dict | None, of: dict) -> dict | None:
    """``base``'s score over just the runs ``of`` also scored (mean, 95 % interval, seeds): the last weights of the
    very runs whose moving average was evaluated, so the two columns differ by the weights alone, not by seeds."""
    if base is None:
        return None
    s = stats([v for p, v in base["per_run"].items() if p in of["per_run"]])
    return None if not s["n"] else {"mean": s["mean"], "ci95": s["ci95"], "seeds": s["n"]}


EMA = ", EMA "
"""what an engine label holds when the row scores the weights' moving average (``rollout_runs``)"""


def verdicts(rows: list[dict], checks: list[dict]) -> list[dict]:
    """Each stream-exact arm's verdict over the datasets it was compared on (``checks``, ``against_protocol``):
    ``fails`` where it fails one, ``meets`` where it passes every dataset on which its model's protocol was
    trained, else ``undecided`` (a dataset where the arm has no run yet, or where the protocol has one seed: no
    interval). ``line`` says so, naming the seeds; the recipes' default training follows the ``meets`` ones
    (tests/eval/test_default_training.py)."""
    protocol_rows = {(r["dataset"], r["data"], r["model"]): r for r in rows if r["engine"] == "recompute"}
    arms = {(r["dataset"], r["data"], r["model"], r["engine"]) for r in rows}
    out = []
    for (arm, model) in dict.fromkeys((c["arm"], c["model"]) for c in checks):
        mine = [c for c in checks if (c["arm"], c["model"]) == (arm, model)]
        failed = [c["dataset"] for c in mine if not c["passes"]]
        sets = ", ".join(f"{c['dataset']}: {c['seeds']} seed{'s' * (c['seeds'] > 1)} against the protocol's "
                         f"{c['protocol_seeds']}" for c in mine)  # a verdict on few seeds reads as what it is
        # the other datasets of the table where the model was trained by the protocol: the criterion needs them
        compared = {c["dataset"] for c in mine}
        missing = [f"{d}, where the arm has no run yet" if (d, data, model, arm) not in arms else
                   f"{d}, where the protocol has {p['seeds']} seed{'s' * (p['seeds'] > 1)} (an interval needs 2)"
                   for (d, data, m), p in protocol_rows.items()
                   if m == model and data == mine[0]["data"] and d not in compared]
        verdict, line = (("fails", f"does not meet it (fails on {', '.join(failed)}; compared on {sets})") if failed
                         else ("undecided", f"passes every dataset compared ({sets}), not compared on "
                                            f"{'; '.join(missing)}: undecided") if missing
                         else ("meets", f"meets the criterion on every dataset compared ({sets})"))
        out.append({"model": model, "data": mine[0]["data"], "arm": arm, "verdict": verdict, "line": line})
    return out


def against_protocol(rows: list[dict], target: str) -> tuple[list[str], list[dict], list[dict], list[dict]]:
    """The measured decision between trainings (docs/evaluation.md, "Which training is the default"), as Markdown
    and as records: each stream-exact arm's mean against the papers' protocol (``recompute``, at least 2 seeds) of
    the same dataset, data and model. The arm passes a dataset when its mean lies inside the protocol's 95 %
    interval or above it (an arm that beats the protocol beyond its interval has shown that exactness costs
    nothing: the interval guards against a cost, so only its lower end is a bound; ``above`` records it) and, where
    the protocol's policies beat their data (its mean lies above the data episodes' level by more than its standard
    error: the dataset separates policies), is not below the protocol's mean by more than that standard error; it
    meets the criterion when it passes every dataset it was compared on (``verdicts``, the third thing returned).
    The weights' moving average (``EMA``) is set against the same training's last weights, and a rate falling to
    the end (``COSINE``) against the constant rate of the same training otherwise: their means and intervals, and
    as records (the fourth thing returned): lever ("moving average" | "cosine"), dataset, data, model, engine (the
    lever's row, which names the training it is set against) and helps (it narrows the interval without lowering
    the mean; None under 2 seeds either side)."""
    proto = {(r["dataset"], r["data"], r["model"]): r for r in rows if r["engine"] == "recompute" and r["seeds"] > 1}
    checks = []
    for r in rows:
        p = proto.get((r["dataset"], r["data"], r["model"]))
        if p is None or not r["engine"].startswith("stream (exact") or EMA in r["engine"]:
            continue
        se = p["std"] / math.sqrt(p["seeds"])
        separates = p["data_level"] is None or p["mean"] - se > p["data_level"]
        above = r["mean"] - p["mean"] > p["ci95"]
        inside, near = r["mean"] >= p["mean"] - p["ci95"], not separates or r["mean"] >= p["mean"] - se
        # how far apart the two means are against the noise of both (Welch's standard error of the difference): the
        # criterion's SE condition fails an arm exactly as good as the protocol about one time in four (equal seed
        # counts and spreads: P(Z < -1/sqrt(2))), so a failed row reads with this beside it
        diff_se = math.sqrt(se ** 2 + (r["std"] ** 2 / r["seeds"] if r["seeds"] > 1 else math.nan))
        checks.append({"dataset": r["dataset"], "data": r["data"], "model": r["model"], "arm": r["engine"],
                       "seeds": r["seeds"], "mean": r["mean"], "protocol_seeds": p["seeds"],
                       "protocol_mean": p["mean"], "protocol_ci95": p["ci95"], "protocol_se": se,
                       "difference": r["mean"] - p["mean"], "difference_se": diff_se,
                       "separates": separates, "inside": inside, "above": above, "near": near,
                       "passes": inside and near})
    raw = {(r["dataset"], r["data"], r["model"], r["engine"]): r for r in rows}
    averaged = [(r, same_runs(raw.get((r["dataset"], r["data"], r["model"], r["engine"].split(EMA)[0])), r))
                for r in rows if EMA in r["engine"]]
    falling = [(r, raw.get((r["dataset"], r["data"], r["model"], re.sub(f"{COSINE}[^,]*", "", r["engine"])))) for r in rows
               if COSINE in r["engine"]]
    decided = verdicts(rows, checks)
    levers = [{"lever": lever, "dataset": r["dataset"], "data": r["data"], "model": r["model"], "engine": r["engine"],
               "helps": better_than(r, b)}
              for lever, pairs in (("moving average", averaged), ("cosine", falling)) for r, b in pairs]
    if not checks and not averaged and not falling:
        return [], [], decided, levers
    yes = lambda b: "yes" if b else "**no**"  # noqa: E731
    md = [f"### Stream-exact training against the papers' protocol, target {target.removeprefix('target')}", ""]
    if checks:
        md += ["A stream-exact arm passes a dataset when its mean lies inside the protocol's (recompute's) 95 % "
               "interval, or above it (`above`: better than the protocol beyond its interval, so no cost), and, "
               "where the protocol's policies beat their data (its mean lies above the data episodes' "
               "level by more than its standard error over seeds: the dataset separates policies), is not below "
               "the protocol's mean by more than that standard error. difference: the arm's mean minus the "
               "protocol's, with the standard error of that difference over both arms' seeds (none for an arm of one "
               "seed); an arm exactly as good as the protocol fails the standard-error condition about one time in "
               "four (equal seed counts and spreads).", "",
               *table(["dataset", "data", "model", "arm", "seeds", "mean", "protocol (seeds)", "difference (SE)",
                       "inside the interval (or above)", "separates", "within one SE", "passes"],
                      [[c["dataset"], c["data"], c["model"], c["arm"], c["seeds"], _fmt(c["mean"]),
                        f"{_fmt(c['protocol_mean'])} +- {_fmt(c['protocol_ci95'])} (SE {_fmt(c['protocol_se'])}, "
                        f"{c['protocol_seeds']})",
                        f"{c['difference']:+.1f}" + ("" if math.isnan(c["difference_se"]) else
                                                     f" ({_fmt(c['difference_se'])})"),
                        "above" if c["above"] else yes(c["inside"]), "yes" if c["separates"] else "no",
                        yes(c["near"]) if c["separates"] else "", yes(c["passes"])] for c in checks]), ""]
        md += [f"- {v['model']}, {v['arm']}: {v['line']}" for v in decided]
        md.append("")
    elif any(r["engine"].startswith("stream (exact") and EMA not in r["engine"] for r in rows):
        md += ["No stream-exact arm is compared yet: the papers' protocol (recompute) of its dataset and model needs "
               "at least 2 seeds for an interval.", ""]
    for lever, pairs, title, columns in (
            ("moving average", averaged, "The weights' moving average against the last weights of the same runs",
             ["moving average", "last weights"]),
            ("cosine", falling, "The learning rate falling along a cosine to the end (lr_schedule=cosine) against the "
                                "constant rate of the same training otherwise", ["cosine", "constant"])):
        if pairs:  # (the records' verdicts, in the pairs' order)
            better = dict(enumerate(x["helps"] for x in levers if x["lever"] == lever))
            md += [*([""] if md[-1] else []), f"{title} (mean +- 95 % interval; the issue's test of a lever: "
                   "it narrows the seed-to-seed interval without lowering the mean):", "",
                   *table(["dataset", "data", "model", "engine", "seeds", *columns, "narrower, not lower"],
                          [[r["dataset"], r["data"], r["model"], r["engine"], r["seeds"],
                            score_cell(r["mean"], r["ci95"], r["seeds"]),
                            "" if b is None else score_cell(b["mean"], b["ci95"], b["seeds"]),
                            "" if better[i] is None else yes(better[i])] for i, (r, b) in enumerate(pairs)])]
            judged = [pairs[i][0] for i, v in better.items() if v is not None]
            held = [pairs[i][0] for i, v in better.items() if v]
            if judged:
                md += ["", f"- {columns[0]}: narrower and not lower in {len(held)} of the {len(judged)} rows of 2 or "
                       "more seeds" + (f" ({'; '.join(r['model'] + ', ' + r['engine'] for r in held)})" if held else "")]
    return md, checks, decided, levers


def better_than(r: dict, b: dict | None) -> bool | None:
    """Whether the lever's row ``r`` narrows the 95 % interval of ``b`` (the same training without it) without
    lowering its mean; None where either has under 2 seeds, so no interval to compare."""
    if b is None or r["seeds"] < 2 or b["seeds"] < 2:
        return None
    return r["ci95"] < b["ci95"] and r["mean"] >= b["mean"]


CSV_COLUMNS = ["dataset", "data", "model", "engine", "seeds", "steps", "episodes", "eval_episodes", "mean", "std", "ci95",
               "best", "best_std", "best_ci95", "data_level", "paper", "val_mse", "val_mse_std", "val_mse_ci95", "val_seeds",
               "s_per_1k", "min_per_run"]


def _band(runs: list[Run], target: str):
    """(steps every run evaluated, mean score there, 95 % half-width over seeds: 0 for one seed)."""
    per_run = [dict(r.curves.get(target, [])) for r in runs]
    steps = sorted(set.intersection(*[set(p) for p in per_run])) if per_run else []
    at = [stats([p[s] for p in per_run]) for s in steps]
    return steps, [a["mean"] for a in at], [a["ci95"] if a["n"] > 1 else 0.0 for a in at]


def plot_curves(groups: list[Group], targets: list[str], path: Path) -> Path:
    return save_figure(curves_figure(groups, targets), path, "report's learning curves")


def curves_figure(groups: list[Group], targets: list[str]):
    from matplotlib.figure import Figure  # not pyplot: no backend, no figure to close

    envs = sorted({g.env for g in groups})
    fig = Figure(figsize=(6.5 * len(targets), 4.6 * len(envs)))
    axes = fig.subplots(len(envs), len(targets), squeeze=False)
    for i, env in enumerate(envs):
        for j, target in enumerate(targets):
            ax, shown = axes[i][j], []
            for g in (g for g in groups if g.env == env):
                steps, mean, half = _band(g.runs, target)
                if not steps:
                    continue
                n, c = len(g.runs), cap(g)
                line, = ax.plot(steps, mean, marker="o", ms=3, lw=2,  # the engine: as in the tables, never unnamed
                                label=f"{g.model}, {g.engine}, {g.data} data, {n} seed{'s' * (n > 1)}"
                                      + (f", episodes capped at {c} steps" if c else ""))
                shown += [m + h for m, h in zip(mean, half)] + [m - h for m, h in zip(mean, half)]
                ax.fill_between(steps, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                                color=line.get_color(), alpha=0.2, lw=0)
            levels = {(g.data, g.runs[0].data_level) for g in groups if g.env == env and g.runs[0].data_level is not None}
            for data, level in sorted(levels):
                ax.axhline(level, color="0.35", ls="--", lw=1.2, label=f"{data} data's episodes: {level:.1f}")
                shown.append(level)
            if shown:  # every curve and level inside the frame with room to spare, none drawn on its edge
                lo, hi = min(shown), max(shown)
                pad = max(0.08 * (hi - lo), 1.0)
                ax.set_ylim(lo - pad, hi + pad)
            ax.set(title=f"{env}, target {target.removeprefix('target')}", xlabel="training step",
                   ylabel="normalized score")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=9, loc="best", framealpha=0.85)
    fig.suptitle("Evaluation during training: mean over seeds, shaded 95% confidence interval")
    fig.tight_layout()
    return fig


def plot_bars(rows_by_target: dict[str, list[dict]], path: Path, caps: dict | None = None) -> Path:
    return save_figure(bars_figure(rows_by_target, caps), path, "report's bar chart")


def bars_figure(rows_by_target: dict[str, list[dict]], caps: dict | None = None):
    """``caps``: (dataset, model, engine) -> ``cap`` of the groups whose episodes were cut short: their bars are
    hatched and labelled so, since the paper's mark beside them counts whole episodes."""
    from matplotlib.figure import Figure

    targets = list(rows_by_target)
    n = max(len(r) for r in rows_by_target.values())
    fig = Figure(figsize=(max(5.0, 1.3 * n + 2) * len(targets), 4.2))
    for ax, target in zip(fig.subplots(1, len(targets), squeeze=False)[0], targets):
        rows = rows_by_target[target]
        cut = [(caps or {}).get((r["dataset"], r["model"], r["engine"])) for r in rows]
        labels = [f"{r['dataset']}\n{r['model']}\n{r['engine']}\n{r['data']}" + (f"\ncapped at {c} steps" if c else "")
                  for r, c in zip(rows, cut)]
        x = range(len(rows))
        for capped_, label in ((False, "ours: mean, 95% CI over seeds"), (True, "ours, episodes capped: not the paper's "
                                                                                "protocol")):
            at = [i for i in x if bool(cut[i]) == capped_]
            if at:
                ax.bar(at, [rows[i]["mean"] for i in at], color="tab:blue", alpha=0.8, hatch="//" if capped_ else None,
                       label=label)
        spread = [(i, r) for i, r in enumerate(rows) if r["seeds"] > 1 and math.isfinite(r["ci95"])]
        if spread:  # a single seed has no interval: no bar is drawn for it
            ax.errorbar([i for i, _ in spread], [r["mean"] for _, r in spread], yerr=[r["ci95"] for _, r in spread],
                        fmt="none", ecolor="black", capsize=5)
        papers = [(i, r["paper"]) for i, r in enumerate(rows) if r["paper"] is not None]
        if papers:
            ax.scatter([i for i, _ in papers], [p for _, p in papers], marker="_", s=600, color="tab:red",
                       zorder=3, label="paper (D4RL data, its budget)")
        for i, r in enumerate(rows):  # inside the bar's foot, clear of the interval's whiskers
            ax.annotate(f"{r['mean']:.1f}\nn={r['seeds']}", (i, 0), ha="center", va="bottom", fontsize=8,
                        color="white", xytext=(0, 4), textcoords="offset points")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set(ylabel="final normalized score", title=f"target {target.removeprefix('target')}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def cap(g: Group) -> str | None:
    """``200`` (or ``200/500``) when ``g``'s evaluation episodes were cut short of the simulator's limit
    (``eval.max_steps``), else None: such scores are not comparable with a paper's, in a table or a plot."""
    caps = sorted({int((r.config.get("eval") or {}).get("max_steps") or 0) for r in g.runs} - {0})
    try:
        limit = envs.get_spec(g.env).max_episode_steps
    except (KeyError, ValueError):
        return None
    return "/".join(map(str, caps)) if caps and caps[0] < limit else None


def capped(groups: list[Group]) -> list[str]:
    """A note for each group whose evaluation episodes were cut short of the simulator's limit (``cap``)."""
    return [f"{g.env} {g.model} ({g.engine}): evaluation episodes capped at {c} steps (eval.max_steps; the "
            f"simulator's limit is {envs.get_spec(g.env).max_episode_steps}), so its scores are not comparable with "
            "the paper's" for g in groups if (c := cap(g))]


def nonfinite(runs: list[Run]) -> list[str]:
    """A note for each NaN or inf score or validation MSE, which that average leaves out."""
    notes = [f"{r.path}: final score for {t} is {v['normalized_mean']}, not averaged"
             for r in runs for t, v in r.final.items() if not math.isfinite(v["normalized_mean"])]
    return notes + [f"{r.path}: validation MSE is {r.val_mse}, not averaged"
                    for r in runs if r.val_mse is not None and not math.isfinite(r.val_mse)]


def report(patterns: list[str], out: str | Path = "report") -> dict:
    """Write the tables and plots for the runs matched by ``patterns``; returns what was written. A run
    whose files are unreadable is left out with a line naming the file and what is wrong."""
    if not patterns:
        raise ValueError("no runs given: name run directories, directories of runs, globs of either or a report's "
                         "runs.json, e.g. python -m eval.report runs/sweep")
    archives = [Path(p) for p in patterns if Path(p).name == "runs.json" and Path(p).is_file()]
    dirs = [p for p in patterns if Path(p) not in archives]
    finished, unfinished = find_runs(dirs) if dirs else ([], [])
    if not finished and not archives:
        raise ValueError(f"no finished run (a directory with summary.json) under {', '.join(patterns)}"
                         + (f"; {len(unfinished)} unfinished: resume them first" if unfinished else ""))
    runs, skipped = [], []
    for d in finished:
        try:
            runs.append(load_run(d))
        except (ValueError, FileNotFoundError) as err:
            print(f"skipped: {err}", file=sys.stderr, flush=True)
            skipped.append(str(err))
    notes = []
    for r in list(runs):  # the final checkpoint's rollouts by other engines: rows of their own
        extra, why = rollout_runs(r)
        runs += extra
        notes += why
    found = {(str(r.path), r.engine) for r in runs}
    for a in archives:
        kept = [r for r in archived_runs(a) if (str(r.path), r.engine) not in found]
        found |= {(str(r.path), r.engine) for r in kept}
        runs += kept
        notes.append(f"{a}: {len(kept)} evaluations of {len({r.path for r in kept})} runs read from it "
                     "(their directories are not among the arguments)")
    trained = len({r.path for r in runs})
    if not runs:
        raise ValueError(f"none of the {len(finished)} finished run(s) could be reported (see the lines above)")
    groups, grouping = group_runs(runs)
    notes += grouping + nonfinite(runs) + capped(groups)
    targets = sorted({t for r in runs for t in r.final}, key=lambda t: -float(t.removeprefix("target")))
    out = Path(out)
    with errors.writing(out, "report directory (nothing was written)"):
        out.mkdir(parents=True, exist_ok=True)
    rows = {t: score_rows(groups, t) for t in targets}
    if not any(rows.values()):
        raise ValueError("no run has a finite final score: " + "; ".join(notes))
    more = f" ({len(runs) - trained} more evaluations by eval.rollout)" if len(runs) > trained else ""
    md = [f"# Report: {trained} runs{more} in {len(groups)} groups", "",
          f"Made by `python -m eval.report {' '.join(map(shlex.quote, patterns))} out={shlex.quote(str(out))}`.", ""]
    md += [f"- note: {cell(n)}" for n in notes]
    md += [f"- left out (unfinished, no summary.json): {d}" for d in unfinished]
    md += [f"- left out (unreadable): {e}" for e in skipped]
    decisions, verdict, levers = {}, {}, {}
    for t in targets:
        md += ["", markdown(rows[t], t)]
        section, decisions[t], verdict[t], levers[t] = against_protocol(rows[t], t)
        md += ["", *section] if section else []
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows[t])
        ck_io.write_atomic(out / f"scores-{t}.csv", text.getvalue(), "report's score table")
    md += ["", "![learning curves](curves.png)", "", "![final scores](scores.png)", ""]
    ck_io.write_atomic(out / "scores.md", "\n".join(md), "report's tables")
    ck_io.write_atomic(out / "runs.json", archive(runs), "report's runs")
    curves = plot_curves(groups, targets, out / "curves.png")
    bars = plot_bars({t: r for t, r in rows.items() if r}, out / "scores.png",
                     {(g.env, g.model, g.engine): c for g in groups if (c := cap(g))})
    return {"markdown": out / "scores.md", "csv": [out / f"scores-{t}.csv" for t in targets], "curves": curves,
            "archive": out / "runs.json",
            "bars": bars, "groups": len(groups), "runs": len(runs), "unfinished": [str(d) for d in unfinished],
            "skipped": skipped, "notes": notes, "rows": rows, "decisions": decisions,
            "verdicts": verdict, "levers": levers}


@dataclass
class ReportConfig:
    runs: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="RUNS")]
    """run directories, directories holding runs (searched recursively), globs of either, or a report's runs.json"""
    out: str = "report"
    """where scores.md, scores-target<T>.csv (one per return target T, e.g. scores-target3600.csv), curves.png,
    scores.png and runs.json go"""


def run(argv: list[str]) -> dict:
    """What ``python -m eval.report`` does; bad input is a ``SetupError``, a refused write a ``WriteError``."""
    paragraphs = __doc__.split("\n\n")
    cfg = cli.parse(ReportConfig, argv, prog="python -m eval.report",
                    description="\n\n".join(paragraphs[:1] + paragraphs[2:]))
    with errors.setup_errors():
        options.check_output_dir(cfg.out, "--out")
        res = report(list(cfg.runs), cfg.out)
    print(Path(res["markdown"]).read_text())
    print(f"wrote {res['markdown']}, {', '.join(map(str, res['csv']))}, {res['curves']}, {res['bars']}, "
          f"{res['archive']}")
    return res


def main(argv: list[str] | None = None) -> dict:
    return errors.main(run, argv)


if __name__ == "__main__":
    main()
