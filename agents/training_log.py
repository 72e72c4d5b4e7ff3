"""What a DT training run shows and leaves behind: the opening announcement, TensorBoard scalars
and histograms, the progress bar (loss, last score, last validation MSE, time left), and at the end
hyper-parameters, ``eval_return.png``, ``val_action_mse.png`` and ``summary.json``. Rank 0 writes;
the other processes' monitors are switched off.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from primal_dt import checkpoint as ck_io
from primal_dt import runtime, train_config
from primal_dt.monitor import RunMonitor
from primal_dt.train_config import TrainConfig

if TYPE_CHECKING:
    from .training import Run


def model_label(cfg: TrainConfig) -> str:
    """The model's name in run directories and logs: the layout, or the explicit layers joined by '-'."""
    return cfg.model.layers.replace(",", "-") if cfg.model.layers else cfg.model.name


VAL_TAG = "val/action_mse"
"""the held-out episodes' masked action MSE (``agents.training_validation``)"""


def held_out(run: Run) -> str:
    """The validation split in words."""
    n = len(run.info.held_out)
    if not n:
        return "no episodes held out (val_fraction=0)"
    steps = int(run.data.lengths[list(run.info.held_out)].sum())
    return (f"{n} held out for validation ({steps:,} steps, val_fraction={run.cfg.val_fraction:g}, drawn by "
            f"seed {run.cfg.seed}; statistics from the other {len(run.data) - n})")


def announcement(run: Run) -> str:
    """What the run is about to do: every option with its provenance, the data, the model, where it writes."""
    cfg = run.cfg
    n_params = sum(p.numel() for p in run.model.parameters())
    return "\n".join([
        train_config.describe(run.built),
        f"data {cfg.env}: {len(run.data)} episodes, {run.data.num_steps:,} steps, source: {run.data.source} "
        f"({run.info.fingerprint[:19]}); {held_out(run)}",
        f"model {model_label(cfg)}: layers {run.model.layer_names}, {n_params:,} parameters, device {run.device}"
        + (f", {run.dist.world} processes (DDP)" if run.dist.world > 1 else ""),
        f"eval targets {list(run.info.targets)}; run directory {run.out}"
        + (f"; resuming at step {run.step}" if run.step else ""),
    ])


def open_monitor(run: Run) -> RunMonitor:
    """The run's monitor, continuing a resumed run's curves (a killed predecessor's events after its
    checkpoint are purged); a new run starts by recording its config and data source."""
    cfg, d = run.cfg, run.dist
    mon = RunMonitor(run.out, enabled=cfg.tensorboard and d.main, progress_total=cfg.steps,
                     progress=cfg.progress and d.main, progress_desc=f"{cfg.env} {model_label(cfg)}",
                     initial=min(run.step, cfg.steps), purge_step=run.step + 1 if run.step else None)
    if mon.bar is not None:  # tqdm's own "remaining" knows nothing of evaluations: the postfix's eta does
        mon.bar.bar_format = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"
    for tag, pts in run.history.items():
        mon.history[tag] = [tuple(p) for p in pts]
    if d.main and run.step == 0:
        mon.text("config", "```\n" + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False) + "\n```")
        mon.text("config/provenance", "```\n" + train_config.describe(run.built) + "\n```")
        mon.text("data/source", f"{run.data.source} ({cfg.env}, {len(run.data)} episodes, "
                                f"{run.data.num_steps} steps, fingerprint {run.info.fingerprint}); {held_out(run)}")
    return mon


def eval_history(mon: RunMonitor) -> dict:
    """The evaluation and validation curves logged so far (what the checkpoint keeps of the log)."""
    return {k: v for k, v in mon.history.items() if k.startswith(("eval/", "val/"))}


def last_eval(mon: RunMonitor) -> float | None:
    """The latest normalized score logged (the first target's), for the progress bar."""
    tags = sorted(t for t in mon.history if t.startswith("eval/normalized/"))
    return mon.history[tags[0]][-1][1] if tags else None


def last_validation(mon: RunMonitor) -> float | None:
    pts = mon.history.get(VAL_TAG)
    return pts[-1][1] if pts else None


def postfix(loss: float, score: float | None, val: float | None, eta: str | None) -> dict:
    """The progress bar's postfix: loss, the last normalized score, the last validation MSE, time left
    (training plus the evaluations still due, ``agents.training_time``)."""
    out = {"loss": f"{loss:.4f}"}
    if score is not None:
        out["score"] = f"{score:.1f}"
    if val is not None:
        out["val_mse"] = f"{val:.4f}"
    if eta is not None:
        out["eta"] = eta
    return out


class Throughput:
    """Seconds and tokens of the optimisation steps since the last logged step."""

    def __init__(self):
        self.seconds, self.steps, self.tokens = 0.0, 0, 0

    def reset(self) -> None:
        self.seconds, self.steps, self.tokens = 0.0, 0, 0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.steps += 1
        self.tokens += tokens

    def take(self) -> dict:
        """Steps/s and tokens/s since the last call, and start counting again."""
        t = max(self.seconds, 1e-9)
        rates = {"throughput/steps_per_s": self.steps / t, "throughput/tokens_per_s": self.tokens / t}
        self.reset()
        return rates


def log_step(run: Run, mon: RunMonitor, loss: float, gn: float, parts: dict, rates: dict) -> None:
    """Loss and its parts, learning rate, grad norm, throughput, KSVD J and Lambda per primal layer."""
    vals = {"loss/total": loss, "loss/action_mse": float(parts["mse"]), "loss/ksvd": float(parts["ksvd"]),
            "train/lr": run.sched.get_last_lr()[0], "train/grad_norm": gn, **rates}
    vals.update({f"ksvd/J_{k.split('/')[1]}": float(v) for k, v in parts.items() if k.startswith("J/")})
    for i, attn in run.model.primal_layers().items():
        lam = attn.Lambda.detach()
        vals.update({f"lambda/layer{i}_mean": float(lam.mean()), f"lambda/layer{i}_min": float(lam.min()),
                     f"lambda/layer{i}_max": float(lam.max())})
        mon.histogram(f"lambda/layer{i}", lam.cpu(), run.step)
    mon.scalars(vals, run.step)


def target_tag(t: float) -> str:
    return f"target{int(t)}" if float(t).is_integer() else f"target{t:g}"


def eval_scalars(results: dict, prefix: str = "eval") -> dict:
    out = {}
    for t, r in results.items():
        tag = target_tag(t)
        out[f"{prefix}/normalized/{tag}"] = r["normalized_mean"]
        out[f"{prefix}/return/{tag}"] = r["return_mean"]
        out[f"{prefix}/length/{tag}"] = r["length_mean"]
    return out


# -- summary.json: its one schema, checked by its writer (``finish``) and its readers (``eval.report``) ---
SUMMARY_FIELDS = {"env": str, "model": str, "seed": int, "steps": int}
"""the fields every summary names, with their JSON types; ``final`` and ``validation`` follow, each an
object or null"""
SCORES = ("normalized_mean", "normalized_std", "return_mean", "return_std", "length_mean")
"""what each target's final evaluation records (numbers; NaN or inf when a rollout went wrong)"""


def _kind(value) -> str:
    return "null" if value is None else {bool: "a boolean", str: "a string", list: "a list", dict: "an object"}.get(
        type(value), f"a {type(value).__name__}")


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def check_summary(summary, where: str) -> dict:
    """``summary`` as ``summary.json`` holds it, or a ValueError saying, for ``where`` (the file),
    which field is wrong and how. Scores may be NaN or inf (JSON as Python writes it): a reader
    decides what to do with them."""
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
    """A run's ``summary.json``, checked (``check_summary``); a ValueError naming the file otherwise."""
    try:
        return check_summary(json.loads(Path(path).read_text()), str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        why = runtime.why(err) if isinstance(err, OSError) else f"not valid JSON ({err})"
        raise ValueError(f"{path} cannot be read: {why}") from err


def finish(run: Run, mon: RunMonitor, final: dict | None, val: float | None = None) -> dict:
    """The run's summary; rank 0 also records hyper-parameters with the final scores and validation
    MSE, draws ``eval_return.png`` and ``val_action_mse.png`` and writes ``summary.json``."""
    cfg = run.cfg
    summary = {
        "env": cfg.env, "model": model_label(cfg), "layers": run.model.layer_names, "seed": cfg.seed,
        "steps": run.step, "data_source": run.data.source, "train_s": round(run.train_time, 2),
        "s_per_1k_steps": round(1000 * run.train_time / max(run.step, 1), 2), "processes": run.dist.world,
        "final": ({target_tag(t): {k: r[k] for k in ("normalized_mean", "normalized_std", "return_mean",
                                                      "return_std", "length_mean")} | {"episodes": len(r["returns"])}
                   for t, r in final.items()} if final else None),
        "validation": ({"action_mse": val, "episodes": run.validation.episodes, "segments": run.validation.segments,
                        "val_fraction": cfg.val_fraction} if val is not None else None),  # which: the checkpoint's data
        "run_dir": str(run.out),
    }
    if run.dist.main:
        metrics = {f"normalized_{target_tag(t)}": r["normalized_mean"] for t, r in (final or {}).items()}
        if val is not None:
            metrics["val_action_mse"] = val
        mon.hparams({"env": cfg.env, "model": model_label(cfg), "data_source": run.data.source,
                     **{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("env", "resume", "out")}},
                    metrics or {"steps": run.step})
        tags = sorted(t for t in mon.history if t.startswith("eval/normalized/"))
        png = mon.plot(tags, run.out / "eval_return.png", title=f"{cfg.env} {model_label(cfg)} seed {cfg.seed}",
                       ylabel="normalized return")
        summary["plot"] = str(png) if png else None
        png = mon.plot([VAL_TAG], run.out / "val_action_mse.png", ylabel="masked action MSE",
                       title=f"{cfg.env} {model_label(cfg)} seed {cfg.seed}: held-out episodes")
        summary["val_plot"] = str(png) if png else None
        check_summary(summary, "the summary training wrote")
        ck_io.write_atomic(run.out / "summary.json", json.dumps(summary, indent=2), "run summary")
        mon.print(json.dumps(summary, indent=2))
    mon.close()
    return summary
