"""``summary.json``, a training run's result: one schema, checked by its writer and its readers
(``eval.report``), so a foreign file is one error naming the field, not a KeyError deep in a table."""

from __future__ import annotations

import json
import math

from primal_dt.run import errors, json_reader

SUMMARY_FIELDS = {"env": str, "model": str, "seed": int, "steps": int}
"""the fields every summary names; ``final`` and ``validation`` are each an object or null"""
SCORES = ("normalized_mean", "normalized_std", "return_mean", "return_std", "length_mean")
"""each target's final scores (NaN or inf when a rollout went wrong)"""


def _kind(value) -> str:
    return "null" if value is None else {bool: "a boolean", str: "a string", list: "a list", dict: "an object"}.get(
        type(value), f"a {type(value).__name__}")


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def check_summary(summary, where: str) -> dict:
    """``summary``, or a ValueError saying which field of ``where`` is wrong (scores may be NaN or inf)."""
    def bad(field: str, want: str, got) -> ValueError:
        shown = "" if got is None else f" ({json.dumps(got)[:60]})"
        return ValueError(f"{where}: {field} must be {want}, got {_kind(got)}{shown}")

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not isinstance(summary, dict):
        raise bad("the file", "a JSON object (a run's summary)", summary)
    for key, kind in SUMMARY_FIELDS.items():
        if key not in summary:
            raise ValueError(f"{where}: no {key!r}; this is not a summary that training wrote")
        if not isinstance(summary[key], kind) or isinstance(summary[key], bool) or summary[key] == "":
            raise bad(key, "an integer" if kind is int else "a non-empty string", summary[key])
    if summary["steps"] < 0 or summary["seed"] < 0:
        raise ValueError(f"{where}: steps and seed must be >= 0, got {summary['steps']} and {summary['seed']}")
    final = summary.get("final")
    if final is not None:
        if not isinstance(final, dict):
            raise bad("final", "an object of target -> scores, or null", final)
        for tag, scores in final.items():
            if not (tag.startswith("target") and _finite(tag[len("target"):])):
                raise ValueError(f"{where}: final: {tag!r} is not a target (target<return>, e.g. target3600)")
            if not isinstance(scores, dict):
                raise bad(f"final.{tag}", "an object of scores", scores)
            if "normalized_mean" not in scores:
                raise ValueError(f"{where}: final.{tag} has no 'normalized_mean'")
            for k in SCORES:
                if k in scores and not number(scores[k]):
                    raise bad(f"final.{tag}.{k}", "a number", scores[k])
    val = summary.get("validation")
    if val is not None and not (isinstance(val, dict) and number(val.get("action_mse"))):
        raise bad("validation", "an object with a number action_mse, or null", val)
    return summary


def read_summary(path) -> dict:
    try:
        return check_summary(json_reader.read(path, nonfinite=True), str(path))  # check_summary flags NaN
    except OSError as err:
        raise ValueError(f"{path} cannot be read: {errors.why(err)}") from err
