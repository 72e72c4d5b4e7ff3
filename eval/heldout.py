"""How well a checkpoint's deployed policy predicts the held-out episodes' actions, step by step.

    python -m eval.heldout runs/hopper-medium-replay/dt/*-seed0 runs/whole/hopper-medium-replay/dt/*-seed0 out=heldout

Each checkpoint's engine (``engine=exact``: the one its training makes exact, ``stream`` or ``recompute``) walks
every episode its run held out (``val_fraction``), fed the dataset's own observations, rewards and previous actions
and conditioned on the episode's own return (teacher forcing), and the action it predicts at each step is set
against the dataset's. Why: the validation MSE a run logs is measured on the segments or chunks it trained on, so
two trainings' figures count different predictions; this one counts, for every training, the predictions its
deployed engine makes, so arms compare on fit where rollouts compare on the closed loop. Held-out episodes depend
on the run's seed: compare runs of the same seed. The error is also split by timestep, where the engines differ
(recompute sees the last K steps, the stream the whole episode so far).

``target=R`` also measures how far the policy follows its return conditioning: the same walk is run conditioned
on the return R (a rollout's target) instead of each episode's own, and the mean squared change of the predicted
actions is reported, overall and by timestep band. A Decision Transformer acts better than its data only by
following a high target; one whose actions barely change with it late in an episode clones the data's average
behaviour there, whatever its fit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import tyro

from eval.bench.timing import machine, table
from primal_dt.run import checkpoint as checkpoint_io
from primal_dt.run import cli, errors, options, runtime

BANDS = (0, 20, 100, 300)
"""timesteps where each band of the per-step error begins (the last runs to the episode's end)"""


def band_names() -> list[str]:
    ends = [*(b - 1 for b in BANDS[1:]), None]
    return [f"{a}-{b}" if b is not None else f"{a}+" for a, b in zip(BANDS, ends)]


def exact_engine(ck) -> str:
    """The engine whose actions are the policy ``ck`` was trained as, the stream where both are (what the trainer's
    evaluation and eval.rollout take by default)."""
    from agents.stream_training import trained_for_stream

    return "stream" if trained_for_stream(ck.config) else "recompute"


@torch.inference_mode()
def heldout_errors(ck, data, engine: str = "exact", weights: str = "model", target: float | None = None) -> dict:
    """The squared action error of ``engine`` over every episode ``ck``'s run held out of ``data`` (its training
    data), teacher-forced: {"action_mse" (mean over every action value), "by_timestep" {band: mean}, "episodes",
    "steps", "engine", "exact", "policy": the engine as ``eval.report`` names it}; with ``target``, also
    "target_response" {"target", "overall", "by_timestep"}: the mean squared change of the predicted actions when
    the same walk is conditioned on the return ``target`` instead of each episode's own (module docstring)."""
    from agents.agent import RecomputeStep
    from agents.decision_transformer import DTStep, StepState
    from eval.report import engine_label, training_label

    eps = np.asarray(ck.data.held_out, np.int64)
    if not len(eps):
        raise ValueError(f"{ck.origin}: its run held no episode out (val_fraction=0): nothing unseen to predict")
    engine = exact_engine(ck) if engine == "exact" else engine
    model = ck.build_model("cpu", weights=weights)
    info = ck.data
    stats = (info.state_mean, info.state_std, info.reward_scale)
    step = DTStep(model, *stats) if engine == "stream" else RecomputeStep(model, *stats)
    starts, lengths = data.starts[eps], data.lengths[eps]
    returns = torch.tensor([float(data.rewards[s:s + n].sum()) for s, n in zip(starts, lengths)])
    state = step.init(len(eps))
    steered = None if target is None else step.init(len(eps))  # the same walk conditioned on ``target``
    reward = torch.zeros(len(eps))
    sse, counted, moved = np.zeros(len(BANDS)), np.zeros(len(BANDS)), np.zeros(len(BANDS))
    for t in range(int(lengths.max())):
        rows = np.minimum(starts + t, starts + lengths - 1)  # an ended episode repeats its last step, not counted
        obs = torch.from_numpy(np.ascontiguousarray(data.observations[rows], dtype=np.float32))
        action, *after = step(obs, reward, None, returns, *state.flat())
        taken = torch.from_numpy(np.ascontiguousarray(data.actions[rows], dtype=np.float32))
        live = torch.from_numpy(t < lengths)
        band = int(np.searchsorted(BANDS, t, side="right")) - 1
        sse[band] += float(((action.float() - taken) ** 2)[live].sum(dtype=torch.float64))
        counted[band] += int(live.sum()) * taken.shape[1]
        # the dataset's action is the next step's a_{t-1}, not the prediction
        state = StepState.of(after)._replace(prev_action=taken.to(action.dtype))
        if steered is not None:
            other, *after = step(obs, reward, None, torch.full_like(returns, target), *steered.flat())
            moved[band] += float(((other.float() - action.float()) ** 2)[live].sum(dtype=torch.float64))
            steered = StepState.of(after)._replace(prev_action=taken.to(other.dtype))
        reward = torch.from_numpy(data.rewards[rows].astype(np.float32))
    f = ck.fidelity(engine)
    policy = engine_label(f) + " (not trained)" * (engine == "recompute" and not f.exact) + training_label(ck.config)
    by_band = lambda sums: {n: float(s / c) if c else None for n, s, c in zip(band_names(), sums, counted)}  # noqa: E731
    out = {"engine": engine, "exact": f.exact, "policy": policy, "weights": weights,
           "episodes": len(eps), "steps": int(lengths.sum()), "action_mse": float(sse.sum() / counted.sum()),
           "by_timestep": by_band(sse)}
    if target is not None:
        out["target_response"] = {"target": float(target), "overall": float(moved.sum() / counted.sum()),
                                  "by_timestep": by_band(moved)}
    return out


@dataclass
class HeldoutConfig:
    checkpoints: Annotated[tuple[str, ...], tyro.conf.Positional, tyro.conf.arg(metavar="CHECKPOINTS")]
    """checkpoints written by primal_dt.train: files or run directories"""
    engine: Literal["exact", "stream", "recompute"] = "exact"
    """exact: each checkpoint's own (stream for a run trained for it: stream_window, whole_episodes, from_start;
    else recompute) | stream | recompute"""
    weights: Literal["model", "ema"] = "model"
    """model: the last training step's weights | ema: their moving average (ema_decay)"""
    target: float = 0.0
    """also walk each checkpoint conditioned on this return (raw, as eval.rollout's targets, e.g. 3600) and report
    how far its actions move from those conditioned on each episode's own return (0: not measured)"""
    data_source: str = ""
    """where the training data is read ('' : where each run read it, its own data_source)"""
    out: str = ""
    """also write the tables (heldout.md) and the records (heldout.json) into this directory, replacing earlier
    ones ('' : print only)"""


def per_checkpoint(records: list[dict]) -> list[str]:
    return table(["checkpoint", "model", "seed", "engine", "weights", "episodes", "steps", "action MSE",
                  *(f"t {b}" for b in band_names())],
                 [[r["checkpoint"], r["model"], r["seed"], r["policy"], r["weights"], r["episodes"], r["steps"],
                   f"{r['action_mse']:.4f}", *("" if v is None else f"{v:.4f}" for v in r["by_timestep"].values())]
                  for r in records])


def against_recompute(records: list[dict]) -> list[str]:
    """Per training and engine: the mean error over its checkpoints and, paired with recompute's checkpoints of the
    same dataset, model and seed (so the same held-out episodes), the mean difference from theirs, overall and in
    each timestep band: the seeds' held-out episodes differ more than the trainings do, so only paired differences
    compare trainings, and the bands say where in an episode a training fits worse."""
    key = lambda r: (r["env"], r["model"], r["policy"], r["weights"])  # noqa: E731
    same = lambda r: (r["env"], r["model"], r["seed"], r["weights"], tuple(r["held_out"]))  # noqa: E731
    protocol = {same(r): r for r in records if r["policy"] == "recompute"}
    bands = band_names()
    rows = []
    for k in dict.fromkeys(map(key, records)):
        mine = [r for r in records if key(r) == k]
        pairs = [(r, protocol[same(r)]) for r in mine if same(r) in protocol and k[2] != "recompute"]
        diff = lambda a, b: None if a is None or b is None else a - b  # noqa: E731
        by_band = [[d for r, p in pairs if (d := diff(r["by_timestep"].get(b), p["by_timestep"].get(b))) is not None]
                   for b in bands]
        rows.append([*k, len(mine), f"{np.mean([r['action_mse'] for r in mine]):.4f}",
                     "" if not pairs else f"{np.mean([r['action_mse'] - p['action_mse'] for r, p in pairs]):+.4f} "
                                          f"({len(pairs)})",
                     *("" if not ds else f"{np.mean(ds):+.4f}" for ds in by_band)])
    return table(["dataset", "model", "engine", "weights", "checkpoints", "action MSE",
                  "minus recompute's, same seeds (pairs)", *(f"t {b}, minus recompute's" for b in bands)], rows)


def target_response(records: list[dict]) -> list[str]:
    """Per training and engine: the mean, over its checkpoints, of how far the predicted actions move when the walk
    is conditioned on the target instead of each episode's own return, overall and in each timestep band."""
    records = [r for r in records if "target_response" in r]
    if not records:
        return []
    key = lambda r: (r["env"], r["model"], r["policy"], r["weights"])  # noqa: E731
    bands, rows = band_names(), []
    for k in dict.fromkeys(map(key, records)):
        mine = [r["target_response"] for r in records if key(r) == k]
        per_band = [[v for m in mine if (v := m["by_timestep"].get(b)) is not None] for b in bands]
        rows.append([*k, len(mine), f"{np.mean([m['overall'] for m in mine]):.4f}",
                     *("" if not vs else f"{np.mean(vs):.4f}" for vs in per_band)])
    target = records[0]["target_response"]["target"]
    return [f"Response to the return target {target:g}: the mean squared change of the predicted actions when the "
            "walk is conditioned on it instead of each episode's own return (teacher-forced, as above)", "",
            *table(["dataset", "model", "engine", "weights", "checkpoints", "response",
                    *(f"t {b}" for b in bands)], rows)]


def run(argv: list[str]) -> list[dict]:
    """What ``python -m eval.heldout`` does; bad input is a ``SetupError`` before any checkpoint is walked."""
    from agents import dt_checkpoint

    cfg = cli.parse(HeldoutConfig, argv, prog="python -m eval.heldout", description=__doc__.split("\n\n")[0])
    with errors.setup_errors(KeyError):
        options.check_output_dir(cfg.out or None)
        if not math.isfinite(cfg.target):
            raise ValueError(f"target={cfg.target}: give a finite return to condition on, e.g. target=3600 (0: none)")
        paths = [dt_checkpoint.resolve(c) for c in cfg.checkpoints]
    runtime.set_threads(1)  # a step of a few rows: one thread is the fastest
    records = []
    for path in paths:
        with errors.setup_errors(KeyError):
            ck = dt_checkpoint.load(path)
            ck.weights(cfg.weights)  # a run that kept no moving average: one line, before any data is read
            data = dt_checkpoint.training_data(ck, cfg.data_source or None, verbose=False)
            if not len(ck.data.held_out):
                raise ValueError(f"{path}: its run held no episode out (val_fraction=0), so there is nothing unseen "
                                 "to predict; train with val_fraction > 0")
        r = heldout_errors(ck, data, cfg.engine, cfg.weights, cfg.target or None)
        records.append({"checkpoint": str(path), "env": ck.data.env, "model": ck.model_config.name,
                        "seed": ck.config.get("seed"), **r, "held_out": list(ck.data.held_out)})
        print(f"{path}: {r['policy']}, action MSE {r['action_mse']:.4f} over {r['steps']} held-out steps", flush=True)
    m = machine("python -m eval.heldout", argv)  # the error does not depend on the machine; its float rounding may
    head = ["# Held-out action error, teacher-forced, by engine", "", f"Command: `{m['command']}`", "",
            f"Machine: {m['cpu']}, torch {m['torch']}, {m['date']}.", ""]
    md = [*per_checkpoint(records), "", *against_recompute(records)]
    if cfg.target:
        md += ["", *target_response(records)]
    print("\n".join(md))
    if cfg.out:
        out = Path(cfg.out)
        with errors.writing(out, "held-out report directory"):
            out.mkdir(parents=True, exist_ok=True)
        checkpoint_io.write_atomic(out / "heldout.md", "\n".join(head + md) + "\n", "held-out tables")
        checkpoint_io.write_atomic(out / "heldout.json", json.dumps(records, indent=2) + "\n", "held-out records")
        print(f"wrote {out / 'heldout.md'}, {out / 'heldout.json'}")
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    return errors.main(run, argv)


if __name__ == "__main__":
    main()
