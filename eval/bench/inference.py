"""Inference benchmark: every way to run a Decision-Transformer policy, side by side, in one run.

    python -m eval.bench.inference checkpoint=RUN seq_episodes=25 json=bench.json markdown=docs/results/inference.md
    python -m eval.bench.inference episodes=0       # latency only, random models
    python -m eval.bench.inference latency=false    # the evaluation only

What each section measures: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from agents.threads import keep_freed_memory
from agents.agent import Agent, load_agent
from agents.onnx_policy import StreamNotTrainedWarning
from primal_dt.run import errors, options, runtime

from . import timing
from .hf import hf_config

RANDOM_MODEL_ENV = "hopper-medium"
"""the dataset whose dimensions, simulator and targets the random models (no checkpoint) take"""
STREAM_PATHS = ("stream", "onnx", "load_agent", "torchscript")
"""``load_agent``: its default runtime (``load_agent(..., runtime="onnx")``), the ``onnx`` row's graph behind the
wrapper a user gets, so ``load_agent/onnx`` is what the wrapper costs (measured with one thread, its own)"""
PROG = "python -m eval.bench.inference"


@dataclass
class BenchConfig(timing.Outputs):
    checkpoint: str = ""
    """kind="dt" checkpoint ('' : random models; the evaluation then runs a random policy)"""
    sizes: tuple[str, ...] = ("256x4", "128x1")
    """model sizes WIDTHxHEADS of the latency section (primal+dt, 3 layers); empty: the checkpoint's only"""
    batches: tuple[int, ...] = (1, 100)
    """agent batch sizes (rows acting at once)"""
    contexts: tuple[int, ...] = (20, 100)
    """context lengths K"""
    ts: tuple[int, ...] = (10, 100, 1000)
    """episode steps at which the stream latency is measured (first size only)"""
    calls: int = 200
    """at most this many act() calls per round and setting (a round's first call after another setting's runs on
    cold caches: few calls per round inflate the fast paths' latencies)"""
    rounds: int = 5
    """rounds, settings interleaved; a latency is the median over rounds"""
    latency: bool = True
    """run the latency section"""
    exported: bool = True
    """include the exported runtimes (ONNX, TorchScript)"""
    hf: bool = True
    """include the HuggingFace baseline (needs `transformers`)"""
    episodes: int = 100
    """Hopper episodes for the evaluation wall-time comparison (0: skip)"""
    lane_layouts: bool = True
    """also time the evaluator with one lane (what the second lane buys)"""
    seq_episodes: int = 0
    """episodes actually run by the sequential loop (0: all); its time is scaled to ``episodes``"""
    max_steps: int = 1000
    """cap on episode length in the evaluation comparison"""
    threads: int = 1
    """torch (and onnxruntime) CPU threads"""
    seed: int = 0
    """seed of the random models and of the evaluation episodes"""


NUMBERS = {"calls": options.AT_LEAST_1, "rounds": options.AT_LEAST_1, "episodes": options.AT_LEAST_0,
           "seq_episodes": options.AT_LEAST_0, "max_steps": options.AT_LEAST_1, "threads": options.AT_LEAST_1,
           "seed": options.SEED, "batches": options.AT_LEAST_1, "contexts": options.AT_LEAST_1,
           "ts": options.AT_LEAST_1}


def parse_size(text: str) -> tuple[int, int]:
    """``"256x4"`` -> (256, 4); a ValueError saying what a size looks like otherwise."""
    try:
        width, heads = (int(v) for v in str(text).lower().split("x"))
    except ValueError:
        raise ValueError(f"sizes: {text!r} is not WIDTHxHEADS (e.g. sizes=256x4,128x1)") from None
    if width < 1 or heads < 1 or width % heads:
        raise ValueError(f"sizes: {text!r} needs a width >= 1 divisible by heads >= 1 (e.g. 256x4)")
    return width, heads


def check(bc: BenchConfig) -> None:
    """What ``NUMBERS`` cannot say: every list names a value, every size parses."""
    for key in ("batches", "contexts", "ts"):
        if not getattr(bc, key):
            raise ValueError(f"{key} must name at least one value, e.g. {key}=1,100")
    for s in bc.sizes:
        parse_size(s)


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, list[str]]:
    return timing.parse(BenchConfig, argv, PROG, __doc__, NUMBERS, prefix="", check=check)


def build_models(bc: BenchConfig):
    """({size name: model}, DataInfo, the checkpoint's model or None): a size equal to the checkpoint's is its
    model, others random. Without a checkpoint the data bookkeeping is hopper-medium's
    with identity statistics and the papers' reward scale."""
    import envs
    from agents import dt_checkpoint
    from agents.decision_transformer import DecisionTransformer, DTConfig
    from agents.train_config import TrainConfig

    trained = None
    if bc.checkpoint:
        ck = dt_checkpoint.load(bc.checkpoint)
        trained, info = ck.build_model(), ck.data
    else:
        spec = envs.get_spec(RANDOM_MODEL_ENV)
        info = dt_checkpoint.DataInfo(env=spec.name, state_mean=np.zeros(spec.obs_dim), state_std=np.ones(spec.obs_dim),
                                      reward_scale=TrainConfig.reward_scale, targets=spec.targets, source="random model")
    own = (trained.cfg.d_model, trained.cfg.n_heads) if trained is not None else (256, 4)
    spec, models = envs.get_spec(info.env), {}
    for w, h in [parse_size(s) for s in bc.sizes] or [own]:
        torch.manual_seed(bc.seed)
        models[f"{w}x{h}"] = trained if trained is not None and (w, h) == own else DecisionTransformer(DTConfig(
            state_dim=spec.obs_dim, act_dim=spec.act_dim, K=20, d_model=w, n_heads=h, n_layers=3, name="primal+dt",
            s=min(64, w // h), dropout=0.0)).eval()
    return models, info, trained


def exported_runtimes(bc: BenchConfig) -> tuple[dict, dict]:
    """({format: policy class}, {format: why it is skipped}) for the exported runtimes available here."""
    if not bc.exported:
        return {}, {f: "exported=false" for f in ("onnx", "torchscript")}
    from agents.export import TorchScriptPolicy, missing_package
    from agents.onnx_policy import OnnxPolicy

    if missing := missing_package():
        return {"torchscript": TorchScriptPolicy}, {"onnx": f"{missing} missing: pip install 'primal-dt[export]'"}
    return {"torchscript": TorchScriptPolicy, "onnx": OnnxPolicy}, {}


def at_context(model, info, K: int):
    """``model`` at context K as a checkpoint in memory."""
    from agents.dt_checkpoint import DTCheckpoint

    return DTCheckpoint(model_config=dataclasses.replace(model.cfg, K=K), model=model.state_dict(), data=info,
                        origin="benchmark model")


def export(model, info, K: int, fmt: str, stem: Path, seconds: dict) -> Path:
    """``model`` at context K exported as ``fmt`` to ``<stem>-<file name>``; the seconds it took go to ``seconds``."""
    from agents.export import FORMATS, export_policy

    ck = at_context(model, info, K)
    t0 = time.perf_counter()
    path = export_policy(ck, format=fmt, out=stem.with_name(f"{stem.name}-{FORMATS[fmt]}"))
    seconds[f"{stem.name}-{fmt}"] = time.perf_counter() - t0
    return path


def policy(model, info, engine: str, K: int, B: int, runtimes: dict, t=None):
    """One ``act`` of ``engine`` (an agent engine, or a format of ``runtimes``: {format: its runtime's maker}) for
    B rows at context K, the policy reset and advanced to episode step ``t`` (default K) first."""
    if engine in runtimes:
        p = runtimes[engine]()
        p.reset(B, target=info.eval_targets[0])
    else:  # the same weights (shared) at context K: recompute's context and the softmax cache
        m = copy.copy(model)
        m.cfg = dataclasses.replace(model.cfg, K=K)
        p = Agent(m, info, engine=engine)
        p.reset(B)
    obs, rew = np.random.default_rng(0).normal(size=(B, model.cfg.state_dim)).astype(np.float32), np.ones(B, np.float32)
    p.act(obs)
    for _ in range((t or K) - 1):
        p.act(obs, rew)
    return lambda: p.act(obs, rew)


def loaded_agent(model, info, K: int):
    """What ``load_agent`` gives for ``model`` at context K by default: its exported step, checked against the torch
    agent, behind the wrapper a user acts through (from a checkpoint in memory: exported again, nothing cached)."""
    with warnings.catch_warnings():  # a random model's stream: the note is not about the benchmark
        warnings.simplefilter("ignore", StreamNotTrainedWarning)
        return load_agent(at_context(model, info, K), runtime="onnx")


def act_latency(size: dict, args, device: torch.device) -> dict[str, float]:
    """{"act batch B": ms per act} of the stream agent (primal+dt, ``size``'s width and heads) on ``device``: each
    act brings its action back to the host, so it ends synchronised."""
    models, info, _ = build_models(BenchConfig(sizes=(f"{size['d_model']}x{size['n_heads']}",)))
    model = next(iter(models.values())).to(device)
    acts = {f"act batch {batch}": policy(model, info, "stream", args.K, batch, {}, t=5) for batch in (1, 100)}
    return timing.median_ms(acts, args.act_calls, 1)


def hf_step(cfg, B: int, K: int):
    """One step of HuggingFace's DT as its documentation runs it: the model on K steps of history for B rows."""
    hf_cfg = hf_config(dataclasses.asdict(cfg), K, 0.0)  # a SetupError where transformers is missing
    from transformers import DecisionTransformerModel

    hf = DecisionTransformerModel(hf_cfg).eval()
    g = torch.Generator().manual_seed(0)
    s, a = torch.randn(B, K, cfg.state_dim, generator=g), torch.rand(B, K, cfg.act_dim, generator=g)
    r, R = torch.zeros(B, K, 1), torch.randn(B, K, 1, generator=g)
    tt, am = torch.arange(K).expand(B, K).contiguous(), torch.ones(B, K, dtype=torch.long)

    def step():
        with torch.inference_mode():
            return hf(states=s, actions=a, rewards=r, returns_to_go=R, timesteps=tt, attention_mask=am,
                      return_dict=True).action_preds[:, -1].numpy()
    return step


def latency_section(models: dict, info, bc: BenchConfig, found: dict, tmp: Path, export_s: dict) -> dict:
    res = {}
    for name, model in models.items():
        res[name] = {}
        for K in bc.contexts:  # an exported runtime takes its thread count when it is made
            runtimes = {fmt: functools.partial(cls, export(model, info, K, fmt, tmp / f"{name}-K{K}", export_s),
                                               threads=bc.threads) for fmt, cls in found.items()}
            if "onnx" in found and bc.threads == 1:
                runtimes["load_agent"] = functools.cache(functools.partial(loaded_agent, model, info, K))
            for B in bc.batches:
                fns = {engine: policy(model, info, engine, K, B, runtimes)
                       for engine in ("stream", *runtimes, "recompute")}
                if bc.hf:
                    fns["hf_recompute"] = hf_step(model.cfg, B, K)
                ms = timing.median_ms(fns, bc.calls, bc.rounds)
                streams = [p for p in STREAM_PATHS if p in ms]
                best = min(streams, key=ms.get)
                e = {"K": K, "batch": B, "ms": ms, "best_stream": best, "ratios":
                     {f"{slow}/{fast}": ms[slow] / ms[fast] for slow in ("recompute", "hf_recompute") if slow in ms
                      for fast in streams} | {f"stream/{fast}": ms["stream"] / ms[fast] for fast in streams[1:]}
                     | ({"load_agent/onnx": ms["load_agent"] / ms["onnx"]} if "load_agent" in ms else {})}
                if bc.hf:
                    e["hf_over_best"] = ms["hf_recompute"] / ms[best]
                res[name][f"K{K}_B{B}"] = e
                print(f"{name} K={K:4d} batch={B:4d}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()),
                      flush=True)
    name, model = next(iter(models.items()))
    for B in bc.batches:  # stream latency versus episode step t: flat, the state does not grow
        ms = timing.median_ms({f"t{t}": policy(model, info, "stream", bc.contexts[0], B, {}, t=t)
                               for t in bc.ts}, bc.calls, bc.rounds)
        e = res[name][f"stream_vs_t_B{B}"] = {"batch": B, "ms": ms, "max_over_min": max(ms.values()) / min(ms.values())}
        print(f"{name} stream batch={B:4d} vs t: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
              + f"  (max/min {e['max_over_min']:.2f})", flush=True)
    return res


def evaluation_section(model, info, bc: BenchConfig) -> dict:
    """The vectorised stream evaluator (two lanes, and with ``bc.lane_layouts`` one) vs the sequential recompute
    loop, in one run; ratios printed."""
    from agents.train_config import RolloutOptions
    from eval.episodes import run_episodes, vector_env
    from eval.rollout import evaluate

    target = info.eval_targets[0]
    n_seq = bc.seq_episodes or bc.episodes
    vec, res = {}, None
    layouts = {"lanes=2 process": 2} | ({"lanes=1": 1} if bc.lane_layouts else {})
    for name, lanes in layouts.items():  # two lanes: the agents in their lanes' processes
        d = {}
        t0 = time.perf_counter()
        options = RolloutOptions(targets=(target,), num_envs=bc.episodes, max_steps=bc.max_steps, engine="stream",
                                 lanes=lanes)
        r = evaluate(model, bc.episodes, bc.seed, options, data=info, details=d)
        vec[name] = time.perf_counter() - t0
        if res is None:
            res, env_steps = r, d["env_steps"]
        print(f"  vectorised stream, {name}: {vec[name]:.2f} s", flush=True)
    # the reference protocol: one episode at a time, a batch-1 recompute agent, the evaluators' loop
    with contextlib.closing(vector_env(info.env, 1, gym_id=info.gym_id)) as venv:
        t0 = time.perf_counter()
        seq = run_episodes(Agent(model, info, engine="recompute"), venv, [(target, e) for e in range(n_seq)],
                           bc.seed, bc.max_steps)
        seq_s = (time.perf_counter() - t0) * bc.episodes / n_seq
    vec_s = vec["lanes=2 process"]
    print(f"  sequential recompute: {seq_s:.2f} s ({n_seq} episodes run, scaled to {bc.episodes})", flush=True)
    return {"episodes": bc.episodes, "env_steps": env_steps, "stream_mean_length": res[target]["length_mean"],
            "stream_return_mean": res[target]["return_mean"], "vectorized_stream_s": vec_s,
            "vectorized_by_layout_s": vec, "sequential_recompute_s": seq_s, "sequential_episodes_run": n_seq,
            "sequential_return_mean_over_run": float(np.mean(seq["returns"])), "speedup": seq_s / vec_s,
            "speedup_by_layout": {k: seq_s / v for k, v in vec.items()}}


def tables(report: dict) -> list[list[str]]:
    """The Markdown tables of the sections a report ran."""
    out = []
    lat = [(size, e) for size, entries in report["latency"].items() for k, e in entries.items() if k[0] == "K"]
    if lat:
        cols = [p for p in (*STREAM_PATHS, "recompute", "hf_recompute") if any(p in e["ms"] for _, e in lat)]
        out.append(timing.table(["size", "K", "batch", *[f"{c} ms" for c in cols], "HF / best stream"],
                                [[s, e["K"], e["batch"], *[f"{e['ms'][c]:.3g}" if c in e["ms"] else "" for c in cols],
                                  f"{e['hf_over_best']:.1f}x" if "hf_over_best" in e else ""] for s, e in lat]))
    if ev := report.get("evaluation"):
        out.append(timing.table(["evaluator", f"seconds for {ev['episodes']} episodes", "x faster than sequential"],
                                [[k, f"{v:.2f}", f"{ev['speedup_by_layout'][k]:.1f}"]
                                 for k, v in ev["vectorized_by_layout_s"].items()]
                                + [["sequential recompute", f"{ev['sequential_recompute_s']:.1f}", "1.0"]]))
    return out


def run(argv: list[str]) -> dict:
    bc, argv = parse_args(argv)
    with errors.setup_errors():
        models, info, trained = build_models(bc)
    runtime.set_threads(bc.threads)
    keep_freed_memory()
    found, skipped = exported_runtimes(bc)
    for fmt, why in skipped.items():
        print(f"skipping the {fmt} runtime: {why}", flush=True)
    machine = timing.machine(PROG, argv)
    print(f"models: {', '.join(f'{k} {m.layer_names}' for k, m in models.items())}; torch {torch.__version__}, "
          f"{bc.threads} thread(s), {machine['cores']} cores, {machine['cpu']}", flush=True)
    export_s: dict = {}
    report = {"machine": machine, "config": dataclasses.asdict(bc), "sizes": list(models),
              "exported": {"formats": sorted(found), "skipped": skipped, "export_s": export_s}}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        report["latency"] = latency_section(models, info, bc, found, Path(tmp), export_s) if bc.latency else {}
    if bc.episodes > 0:
        report["evaluation"] = evaluation_section(trained if trained is not None else next(iter(models.values())), info, bc)
    timing.write(report, bc.json, bc.markdown, "Acting speed: stream, ONNX, TorchScript, recompute and HuggingFace"
                 f" (ms per act; {bc.threads} torch thread(s))", tables(report))
    return report


def main(argv=None) -> dict:
    """``python -m eval.bench.inference``: bad options or checkpoints end as every entry point's (errors.main)."""
    return errors.main(run, argv)


if __name__ == "__main__":
    main()
