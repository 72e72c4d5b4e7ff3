"""A DT training run's ``summary.json``: its schema, its one writer and its one reader.

Training writes it at the end of a run; ``eval.report`` (and ``eval.sweep`` through it) reads back every
run's, possibly from another release or a hand-edited file, so the schema lives in one file both import:
a field training stops writing or the report starts reading is changed here once, and a summary that does not
fit is one error naming its field, not a KeyError in a table.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from primal_dt.run import checkpoint as ck_io
from primal_dt.run import errors, json_reader, presets

from . import stream_training, train_config
from .train_config import TrainConfig, model_label

FILENAME = "summary.json"
SUMMARY_FIELDS = {"env": str, "model": str, "seed": int, "steps": int}
"""the fields every summary names; ``final`` and ``validation`` are each an object or null"""
SCORES = ("normalized_mean", "normalized_std", "return_mean", "return_std", "length_mean")
"""each target's final scores (NaN or inf when a rollout went wrong)"""


def target_tag(t: float) -> str:
    """A return target's name in ``final`` and in the run's curves (``eval/normalized/target3600``)."""
    return f"target{int(t)}" if float(t).is_integer() else f"target{t:g}"


def finite_number(text: str) -> bool:
    """Whether ``text`` (a target tag's number) reads as a finite number."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class Held:
    """What the final validation measured: its masked action MSE over ``segments`` segments of ``episodes``
    held-out episodes."""

    action_mse: float
    episodes: int
    segments: int


def build_summary(cfg: TrainConfig, *, layers: list[str], steps: int, data_source: str, train_time: float,
                  processes: int, final: dict | None, held: Held | None, run_dir: Path) -> dict:
    """The summary of a run of ``cfg`` that reached ``steps`` after ``train_time`` seconds of optimisation steps;
    ``final``: the final evaluation's results by target (the evaluator's, or None), ``held``: the final
    validation (or None). The plots' paths are added by the writer's caller when it draws them."""
    return {
        "env": cfg.env, "model": model_label(cfg), "layers": layers, "seed": cfg.seed,
        "steps": steps, "data_source": data_source, "train_s": round(train_time, 2),
        "s_per_1k_steps": round(1000 * train_time / max(steps, 1), 2), "processes": processes,
        "final": ({target_tag(t): {k: r[k] for k in SCORES} | {"episodes": len(r["returns"])}
                   for t, r in final.items()} if final else None),
        # which policy the final scores are of (agents.stream_training.Fidelity)
        **(stream_training.fidelity(cfg.eval.engine, dataclasses.asdict(cfg)).record() if final else {}),
        "validation": ({"action_mse": held.action_mse, "episodes": held.episodes, "segments": held.segments,
                        "val_fraction": cfg.val_fraction} if held is not None else None),  # which: the checkpoint's data
        "run_dir": str(run_dir),
    }


def write_summary(summary: dict, directory: Path) -> Path:
    """Write ``summary`` (checked first: training never writes one its reader refuses) atomically as
    ``directory/summary.json``; its path."""
    check_summary(summary, "the summary training wrote")
    return ck_io.write_atomic(directory / FILENAME, json.dumps(summary, indent=2), "run summary")


def check_summary(summary, where: str) -> dict:
    """``summary``, or a ValueError saying which field of ``where`` is wrong (scores may be NaN or inf)."""
    def bad(field: str, want: str, got) -> ValueError:
        kinds = {bool: "a boolean", str: "a string", list: "a list", dict: "an object", type(None): "null"}
        shown = "" if got is None else f" ({json.dumps(got)[:60]})"
        return ValueError(f"{where}: {field} must be {want}, got {kinds.get(type(got), f'a {type(got).__name__}')}"
                          f"{shown}")

    if not isinstance(summary, dict):
        raise bad("the file", "a JSON object (a run's summary)", summary)
    for key, kind in SUMMARY_FIELDS.items():
        if key not in summary:
            raise ValueError(f"{where}: no {key!r}; this is not a summary that training wrote")
        if not presets.fits(summary[key], kind) or summary[key] == "":
            raise bad(key, "an integer" if kind is int else "a non-empty string", summary[key])
    if summary.get("engine", train_config.ENGINES[0]) not in train_config.ENGINES:  # labels the report's rows
        raise bad("engine", f"one of {', '.join(train_config.ENGINES)}", summary["engine"])
    if summary["steps"] < 0 or summary["seed"] < 0:
        raise ValueError(f"{where}: steps and seed must be >= 0, got {summary['steps']} and {summary['seed']}")
    final = summary.get("final")
    if final is not None:
        if not isinstance(final, dict):
            raise bad("final", "an object of target -> scores, or null", final)
        for tag, scores in final.items():
            if not (tag.startswith("target") and finite_number(tag[len("target"):])):
                raise ValueError(f"{where}: final: {tag!r} is not a target (target<return>, e.g. target3600)")
            if not isinstance(scores, dict):
                raise bad(f"final.{tag}", "an object of scores", scores)
            if "normalized_mean" not in scores:
                raise ValueError(f"{where}: final.{tag} has no 'normalized_mean'")
            for k in SCORES:
                if k in scores and not presets.fits(scores[k], float):
                    raise bad(f"final.{tag}.{k}", "a number", scores[k])
    val = summary.get("validation")
    if val is not None and not (isinstance(val, dict) and presets.fits(val.get("action_mse"), float)):
        raise bad("validation", "an object with a number action_mse, or null", val)
    return summary


def read_summary(path) -> dict:
    """``summary.json`` as ``eval.report`` reads it: one error naming the field, not a KeyError in a table."""
    try:
        return check_summary(json_reader.read(path, nonfinite=True), str(path))  # check_summary flags NaN
    except OSError as err:
        raise ValueError(f"{path} cannot be read: {errors.why(err)}") from err
