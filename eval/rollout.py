"""Roll out a Decision-Transformer checkpoint in its Gymnasium MuJoCo simulator, many episodes at once.

    python -m eval.rollout checkpoint=runs/hopper-medium/primal+dt/.../last.pt episodes=100 engine=stream
    python -m eval.rollout checkpoint=PATH engine=recompute targets=3600 num_envs=50 asynchronous=true
    python -m eval.rollout checkpoint=PATH episodes=10 video=true          # + one recorded episode

Episodes run side by side in lanes of simulators (``eval.episodes``, ``eval.simulators``). Episode e of every
target resets with seed ``seed + e``, so targets, engines, lanes and ``num_envs`` are compared on the same
initial states. The report (return and normalized score per target, lengths, the agent's time per ``act``)
goes to ``rollout-<engine>.json`` beside the checkpoint, numbered rather than overwriting one; an explicit ``out=``
is held by the rollout writing it, so a second one given the same file is refused (never one report lost to the
other). ``evaluate`` is the trainer's entry point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import numpy as np
import torch

from agents.threads import inference_threads, lane_threads
from eval.episodes import run_episodes, vector_env
from eval.simulators import SimulatorProcess
from primal_dt.run import checkpoint as checkpoint_io
from primal_dt.run import errors, outputs, runtime
from primal_dt.run.options import AT_LEAST_1, SEED, THREADS, check_device, check_numbers
from agents.train_config import RolloutOptions, TrainConfig
from primal_dt.run.monitor import EpisodeBar


def summarize(spec, targets: Sequence[float], jobs, result: dict) -> dict:
    out = {}
    for t in targets:
        idx = [k for k, (tt, _) in enumerate(jobs) if tt == float(t)]
        rets, lens = [result["returns"][k] for k in idx], [int(result["lengths"][k]) for k in idx]
        norm = (100.0 * (np.asarray(rets) - spec.ref_min) / (spec.ref_max - spec.ref_min)).tolist()
        out[float(t)] = {"returns": rets, "lengths": lens, "normalized": norm,
                         "return_mean": float(np.mean(rets)), "return_std": float(np.std(rets)),
                         "normalized_mean": float(np.mean(norm)), "normalized_std": float(np.std(norm)),
                         "length_mean": float(np.mean(lens)), "length_min": int(min(lens)),
                         "length_max": int(max(lens))}
    return out


def latency(act_s: Sequence[float], batch: int, act_rows: Sequence[int]) -> dict:
    """Agent ms per act() call while all ``batch`` rows run (the batch shrinks in an evaluation's tail; the
    first 5 calls are warm-up) and ``per_row_mean_ms`` over all calls: total act time / rows acted for."""
    pairs = list(zip(act_s, act_rows))
    pairs = pairs[5:] if len(pairs) > 10 else pairs
    ms = sorted([1e3 * x for x, r in pairs if r == batch] or [1e3 * x for x, _ in pairs])
    p = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {"batch": batch, "calls": len(ms), "mean_ms": statistics.fmean(ms), "median_ms": p(0.5),
            "p90_ms": p(0.9), "p99_ms": p(0.99),
            "per_row_mean_ms": 1e3 * sum(x for x, _ in pairs) / max(1, sum(r for _, r in pairs)),
            "total_act_s": sum(act_s)}


# -- the trainer's entry point ------------------------------------------------------------------------
def evaluate(model, episodes: int, seed: int, options: RolloutOptions = RolloutOptions(), *, data=None,
             on_episode: Callable[[int], None] | None = None, details: dict | None = None) -> dict:
    """Roll out ``episodes`` episodes per target; {target: {"returns", "lengths", "normalized",
    "return_mean", "normalized_mean", "length_mean", ...}}. ``model``: a DecisionTransformer with ``data``
    (its training data's ``DataInfo``), or a checkpoint (path, run directory, dict, ``DTCheckpoint``).
    ``on_episode(n)``: called as ``n`` episodes end; ``details`` receives the agent latency, wall time and
    lane layout."""
    import envs
    from agents import dt_checkpoint
    from agents.agent import Agent

    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    options.check()
    if not isinstance(model, torch.nn.Module):
        ck = dt_checkpoint.load(model)
        data = ck.data if data is None else data
        model = ck.build_model()
    if data is None:
        raise ValueError("data (the training data's DataInfo: statistics, reward_scale, env) is required when "
                         "evaluating a model; a checkpoint carries it")
    spec = envs.get_spec(data.env)
    targets = options.targets or data.eval_targets
    jobs = [(float(t), e) for t in targets for e in range(episodes)]
    was_training = model.training  # each Agent puts the model in eval mode
    n = max(1, min(options.num_envs, len(jobs)))
    n_lanes = min(n, options.lanes or (1 if options.asynchronous else 2))
    in_process = n_lanes > 1 and not options.asynchronous
    widths = [n // n_lanes + (k < n % n_lanes) for k in range(n_lanes)]
    try:
        agents = [Agent(model, data, target=float(targets[0]), engine=options.engine) for _ in widths]
        venvs = []
        t0 = time.perf_counter()
        with contextlib.ExitStack() as opened:  # every lane's simulators closed however it ends
            for w in widths:
                venvs.append(SimulatorProcess(spec.name, w, data.gym_id, threads=lane_threads(options.engine, w, n_lanes))
                             if in_process else vector_env(spec.name, w, options.asynchronous, data.gym_id))
                opened.callback(venvs[-1].close)
            res = run_episodes(agents, venvs, jobs, seed, options.max_steps or spec.max_episode_steps, on_episode)
        wall = time.perf_counter() - t0
    finally:
        model.train(was_training)
    if details is not None:
        details.update({"latency": latency(res["act_s"], widths[0], res["act_rows"]), "wall_s": wall,
                        "env_steps": res["env_steps"], "num_envs": n, "lanes": n_lanes, "engine": options.engine,
                        "asynchronous": options.asynchronous})
    return summarize(spec, targets, jobs, res)


# -- command line ---------------------------------------------------------------------------------
@dataclass(kw_only=True)
class RolloutConfig(RolloutOptions):
    """Options of ``python -m eval.rollout``; those of ``RolloutOptions`` are training's ``eval.*`` (the same
    names, types and defaults; ``eval.targets=...`` is accepted too, so an option copied from training works)."""

    checkpoint: str
    """a checkpoint written by primal_dt.train: its file, its run directory, or a directory of runs (the newest
    run under it that holds a checkpoint; it says which)"""
    weights: Literal["model", "ema"] = "model"
    """model: the last training step's weights | ema: their moving average, which runs keep (ema_decay); its report
    is rollout-<engine>-ema.json, and eval.report shows it as a row of its own"""
    episodes: int = 100
    """episodes per target"""
    seed: int = 0
    """episode e uses reset seed seed + e"""
    out: str = ""
    """JSON report path ('' : rollout-<engine>.json next to the checkpoint, or rollout-<engine>-2.json, ... when
    an earlier report holds the name)"""
    overwrite: bool = False
    """let an explicit out= replace an existing file (an earlier report is never replaced otherwise)"""
    check_data: bool = False
    """read the training data first and refuse the checkpoint if its recorded dataset fingerprint differs (by default
    no dataset is read: the checkpoint carries its statistics)"""
    data_source: str = ""
    """where check_data reads the data ('' : where the run read it, its own data_source; else auto | d4rl:PATH |
    minari:ID | ...); giving it implies check_data=true"""
    video: bool = False
    """also record one episode (MuJoCo off-screen rendering) as a GIF and into TensorBoard"""
    threads: int = 0
    """torch CPU threads (0: chosen for the engine and batch: one for small batches, else half the cores)"""
    device: str = TrainConfig.device
    """auto | cpu | cuda | cuda:N (auto: CUDA when present), as in training"""
    progress: bool = True
    """progress bars on a terminal; written to a file or a pipe, a plain progress line a minute instead
    (false: no bars)"""


SHORTHANDS = {f"eval.{f.name}": f.name for f in dataclasses.fields(RolloutOptions)}
PROG = "python -m eval.rollout"
DESCRIPTION = "Roll out a Decision-Transformer checkpoint in its simulator, many episodes at once."

NUMBERS = {"episodes": AT_LEAST_1, "seed": SEED, "threads": THREADS}
"""what the other numeric options accept (the shared ones: ``RolloutOptions.check``)"""


def check(cfg: RolloutConfig) -> None:
    """Every option, before anything is loaded or simulated."""
    cfg.check()
    check_numbers(cfg, NUMBERS)
    check_device(cfg.device)
    blocked = next((d for d in Path(cfg.out).parents if d.exists() and not d.is_dir()), None) if cfg.out else None
    if blocked or (cfg.out and Path(cfg.out).is_dir()):  # else refused only when the report is written, at the end
        raise ValueError(f"out={cfg.out}: {blocked or cfg.out} is a {'file' if blocked else 'directory'}; give the "
                         "report's file path, e.g. out=rollout.json")
    if cfg.out and not cfg.overwrite and (taken := outputs.taken(Path(cfg.out), "rollout report", "out")):
        raise ValueError(taken)


def run(argv: list[str]) -> dict:
    """What ``python -m eval.rollout`` does; bad input is a ``SetupError`` before any simulation."""
    import envs
    from agents import dt_checkpoint, stream_training
    from primal_dt.run.cli import given, parse

    cfg = parse(RolloutConfig, argv, prog=PROG, description=DESCRIPTION, shorthands=SHORTHANDS)
    with errors.setup_errors(KeyError):
        check(cfg)
        path = dt_checkpoint.resolve(cfg.checkpoint)
        digest = checkpoint_io.sha256_file(path)  # what eval.report matches the report to its run by
        ck = dt_checkpoint.load(path)
        spec = envs.get_spec(ck.data.env)
        if cfg.check_data or cfg.data_source:
            dt_checkpoint.training_data(ck, cfg.data_source or None)
        model = ck.build_model(runtime.pick_device(cfg.device), weights=cfg.weights)
    streams = stream_training.trained_for_stream(ck.config)
    if "engine" not in given(RolloutConfig, argv, SHORTHANDS) and streams:  # its policy, at O(1) per step
        cfg = dataclasses.replace(cfg, engine="stream")
        print(f"engine=stream: checkpoint {path} is trained for the stream ({streams}), which computes its policy "
              "exactly, one step per simulator step (engine=recompute to compare)")
    runtime.set_threads(cfg.threads or inference_threads(cfg.engine, cfg.num_envs))  # 0: chosen for the batch
    targets = cfg.targets or ck.data.eval_targets
    name = path.parent / f"rollout-{cfg.engine}{'-ema' * (cfg.weights == 'ema')}.json"
    # out= is held from here to the report, so a second rollout given it is refused, not its report replaced
    with (outputs.claimed(Path(cfg.out), "rollout report", "out", replace=cfg.overwrite) if cfg.out
          else outputs.new_file(name, "rollout report")) as out:
        if note := ck.fidelity(cfg.engine).note(f"checkpoint {path}"):
            print(note)
        try:
            # the video beside the report: in out='s folder when given, else in the run directory
            report = _rollout(cfg, path, ck, spec, model, targets, out.parent) | {"checkpoint_sha256": digest}
        except KeyboardInterrupt:
            print(f"interrupted: no report written ({out} would have held it)", flush=True)
            raise
        # atomic: a write that fails (a full disk, ulimit -f) leaves no truncated report under the name
        checkpoint_io.write_atomic(out, json.dumps(report, indent=2), "rollout report")
    print(summary_text(report))
    print(f"report: {out}")
    return report


def _rollout(cfg: RolloutConfig, path: Path, ck, spec, model, targets, out_dir: Path) -> dict:
    info = ck.data
    bar = EpisodeBar(cfg.episodes * len(targets), f"{spec.name} {cfg.engine}") if cfg.progress else None
    details: dict = {}
    # setup_errors: e.g. a simulator the checkpoint names that cannot be built; the bar closes however it ends
    with bar if bar is not None else contextlib.nullcontext(), errors.setup_errors():
        res = evaluate(model, cfg.episodes, cfg.seed, cfg, data=info, on_episode=bar.update if bar else None,
                       details=details)
    report = {"checkpoint": str(path), "env": spec.name, "gym_id": info.gym_id or spec.gym_id,
              **ck.fidelity(cfg.engine).record(), "weights": cfg.weights, "episodes_per_target": cfg.episodes,
              "seed": cfg.seed, **{k: details[k] for k in ("num_envs", "lanes", "env_steps")},
              "asynchronous": cfg.asynchronous, "max_steps": cfg.max_steps or spec.max_episode_steps,
              "model_layers": model.layer_names, "train_step": ck.step, "data_source": info.source,
              "data_fingerprint": info.fingerprint or None, "wall_s": round(details["wall_s"], 3),
              "env_steps_per_s": details["env_steps"] / max(details["wall_s"], 1e-9), "agent_latency": details["latency"],
              "reference_scores": {"random": spec.ref_min, "expert": spec.ref_max, "source": spec.ref_source},
              "targets": {_tag(t): r for t, r in res.items()}}
    if cfg.video:
        from eval.video import record_episode

        report["video"] = record_episode(model, spec, info, targets[0], cfg.engine, cfg.seed,
                                         out_dir=out_dir, gym_id=info.gym_id, max_steps=cfg.max_steps or None,
                                         step=ck.step)
    return report


def main(argv: list[str] | None = None) -> dict:
    return errors.main(run, argv)


def _tag(t: float) -> str:
    return str(int(t)) if math.isfinite(t) and float(t).is_integer() else f"{t:g}"


def summary_line(results: dict) -> str:
    """'3600: 55.1 +- 3.2 (return 1771, length 580), 1800: ...' from ``evaluate``'s result."""
    return ", ".join(f"{_tag(t)}: {d['normalized_mean']:.1f} +- {d['normalized_std']:.1f} "
                     f"(return {d['return_mean']:.0f}, length {d['length_mean']:.0f})" for t, d in results.items())


def _groups(lanes: int) -> str:
    """``eval.lanes`` in words: how the simulators were split (one group stepping while another's agent acts)."""
    return "one group" if lanes == 1 else f"{lanes} groups, one stepping while another's agent acts"


def summary_text(report: dict) -> str:
    policy = "the trained policy" if report.get("exact") else "NOT the trained policy"
    weights = ", weights=ema (the weights' moving average)" if report.get("weights") == "ema" else ""
    lines = [f"{report['env']} ({report['gym_id']}), engine={report['engine']} ({policy}){weights}, "
             f"{report['episodes_per_target']} episodes/target on {report['num_envs']} "
             f"{'async' if report['asynchronous'] else 'sync'} simulators ({_groups(report.get('lanes', 1))}), "
             f"{report['wall_s']:.1f}s ({report['env_steps_per_s']:.0f} env steps/s)"]
    for tag, r in report["targets"].items():
        lines.append(f"  target {tag}: normalized {r['normalized_mean']:.1f} +- {r['normalized_std']:.1f}, "
                     f"return {r['return_mean']:.0f} +- {r['return_std']:.0f}, length {r['length_mean']:.0f} "
                     f"[{r['length_min']}, {r['length_max']}]")
    if lat := report.get("agent_latency"):
        lines.append(f"  agent: {lat['mean_ms']:.3f} ms per act for {lat['batch']} rows "
                     f"(median {lat['median_ms']:.3f}, p90 {lat['p90_ms']:.3f}; "
                     f"{lat['per_row_mean_ms']:.4f} ms per row)")
    if v := report.get("video"):
        lines.append(f"  video: {v.get('message') or v['path']}"
                     + (f"; TensorBoard: {v['tensorboard']}" if v.get("tensorboard") else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
