"""Inference benchmark: every way to run a Decision-Transformer policy, side by side, in one run.

    python -m eval.bench.inference checkpoint=RUN seq_episodes=25 json=bench.json markdown=docs/results/inference.md
    python -m eval.bench.inference episodes=0 thread_table=false       # latency only, random models
    python -m eval.bench.inference latency=false thread_table=false    # the evaluation only

Every ratio is taken inside this run, on this machine; the bench measures, the reader judges. Sections
(``BenchConfig`` says what each option adds): **latency** per ``act`` of every engine (torch stream, the
exported ONNX / TorchScript step, recompute, HuggingFace's DT as its documentation uses it) per
size, context and batch, with ratios, then the stream's latency against the episode step (flat);
**threads**: each engine at batch 1 and 100 with the runtime's default threads, 1, 2 and
``agents.threads.inference_threads``' choice, idle and beside one busy process; **evaluation**
(``eval/bench/evaluator.py``): the vectorised stream evaluator vs the sequential recompute loop.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from agents.threads import inference_threads, keep_freed_memory, usable_cores
from eval.bench.evaluator import evaluation_section, make_agent
from primal_dt.attention.precision import native_bf16
from primal_dt.run import errors, options, runtime

from . import timing
from .train import hf_config

RANDOM_MODEL_ENV = "hopper-medium"
"""the dataset whose dimensions, simulator and targets the random models (no checkpoint) take"""
STREAM_PATHS = ("stream", "onnx", "torchscript")
EXACT_PATHS = ("stream", "onnx", "torchscript")
"""the stream paths that reproduce the model's float32 actions (to 1e-5)"""
RECOMPUTE_PATHS = ("recompute", "hf_recompute", "hf_recompute_bf16")
TORCH_DEFAULT_THREADS = torch.get_num_threads()
"""torch's own thread count in this process before anything set it (its default: the physical cores)"""
PROG = "python -m eval.bench.inference"


@dataclass
class BenchConfig:
    checkpoint: str = ""
    """kind="dt" checkpoint ('' : random models; the evaluation then runs a random policy)"""
    layout: str = "primal+dt"
    """layout of the random models"""
    sizes: tuple[str, ...] = ("256x4", "128x1")
    """model sizes WIDTHxHEADS for the latency and threads sections (3 layers); empty: the checkpoint's only"""
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
    """include the exported runtimes (ONNX, TorchScript) in the latency and threads sections"""
    hf: bool = True
    """include the HuggingFace baseline (needs `transformers`)"""
    bf16: bool = True
    """include HF in bfloat16 in the latency section, on a CPU with native bfloat16 matmuls (AVX512-BF16 or AMX)"""
    bf16_emulated: bool = False
    """run the bf16 path on a CPU without native bfloat16 too (emulated: far slower than fp32, minutes per size)"""
    thread_table: bool = True
    """run the threads section (first size, first context)"""
    compete: bool = True
    """threads section: also measure beside one CPU-bound process started by the bench"""
    episodes: int = 100
    """Hopper episodes for the evaluation wall-time comparison (0: skip)"""
    lane_layouts: bool = True
    """also time the evaluator with thread lanes and with one lane (what the process lanes buy)"""
    seq_episodes: int = 0
    """episodes actually run by the sequential loop (0: all); its time is scaled to ``episodes``"""
    max_steps: int = 1000
    """cap on episode length in the evaluation comparison"""
    threads: int = 1
    """torch (and onnxruntime) CPU threads in the latency section and the evaluation"""
    json: str = ""
    """also write the report here"""
    markdown: str = ""
    """also write the tables here as Markdown, headed by the machine and the command (e.g. docs/results/inference.md)"""
    seed: int = 0
    """seed of the random models and of the evaluation episodes"""


NUMBERS = {"calls": options.AT_LEAST_1, "rounds": options.AT_LEAST_1, "episodes": options.AT_LEAST_0,
           "seq_episodes": options.AT_LEAST_0, "max_steps": options.AT_LEAST_1, "threads": options.AT_LEAST_1,
           "seed": options.SEED}


def int_list(bc: BenchConfig, key: str) -> list[int]:
    """A list option (``batches=1,100``; the parser made it integers) checked: >= 1, at least one."""
    values = list(getattr(bc, key))
    options.check_number(key, values or None, options.AT_LEAST_1)
    if not values:
        raise ValueError(f"{key} must name at least one value, e.g. {key}=1,100")
    return values


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
    """Every option, before a model is built or a simulator started."""
    options.check_numbers(bc, NUMBERS)
    for key in ("batches", "contexts", "ts"):
        int_list(bc, key)
    for s in bc.sizes:
        parse_size(s)
    timing.check_files(bc.json, bc.markdown, prefix="")


def build_models(bc: BenchConfig):
    """({size name: model}, DataInfo, the checkpoint's model or None): a size equal to the checkpoint's is its
    model, others random (3 layers, ``layout``). Without a checkpoint the data bookkeeping is hopper-medium's
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
            state_dim=spec.obs_dim, act_dim=spec.act_dim, K=20, d_model=w, n_heads=h, n_layers=3, name=bc.layout,
            s=min(64, w // h), dropout=0.0)).eval()
    return models, info, trained


def with_context(model, K: int):
    """The same weights (shared) with context length K: it sets recompute's context and the softmax cache."""
    m = copy.copy(model)
    m.cfg = dataclasses.replace(model.cfg, K=K)
    return m


def hf_model(cfg, K: int, dtype=torch.float32):
    c = hf_config(dataclasses.asdict(cfg), K, 0.0)  # a SetupError where transformers is missing
    from transformers import DecisionTransformerModel

    return DecisionTransformerModel(c).eval().to(dtype)


def exported_runtimes(bc: BenchConfig) -> tuple[dict, dict]:
    """({format: policy class}, {format: why it is skipped}) for the exported runtimes available here."""
    if not bc.exported:
        return {}, {f: "exported=false" for f in ("onnx", "torchscript")}
    try:
        from agents.export import export_policy  # noqa: F401
        from agents.torchscript_policy import TorchScriptPolicy
    except ImportError as err:
        return {}, {f: f"agents.export is not available ({err})" for f in ("onnx", "torchscript")}
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401

        from agents.onnx_policy import OnnxPolicy
    except ImportError as err:
        return {"torchscript": TorchScriptPolicy}, {"onnx": f"onnx / onnxruntime missing ({err}): pip install "
                                                            "'primal-dt[export]'"}
    return {"torchscript": TorchScriptPolicy, "onnx": OnnxPolicy}, {}


class Exports:
    """Exported artefacts of the benchmarked models, one per (size, K, format), made on first use into a
    temporary directory (``agents.export.export_policy`` of an in-memory checkpoint)."""

    def __init__(self, info):
        self.info, self.dir, self.paths, self.export_s = info, tempfile.TemporaryDirectory(prefix="bench-"), {}, {}

    def path(self, size: str, model, K: int, fmt: str) -> Path:
        if (size, K, fmt) not in self.paths:
            from agents.dt_checkpoint import DTCheckpoint
            from agents.export import FORMATS, export_policy

            ck = DTCheckpoint(model_config=dataclasses.replace(model.cfg, K=K), model=model.state_dict(),
                              data=self.info, origin="benchmark model")
            t0 = time.perf_counter()
            out = Path(self.dir.name) / f"{size}-K{K}-{FORMATS[fmt]}"
            self.paths[(size, K, fmt)] = export_policy(ck, format=fmt, out=out)
            self.export_s[f"{size}-K{K}-{fmt}"] = time.perf_counter() - t0
        return self.paths[(size, K, fmt)]


def advanced(policy, B: int, t: int, state_dim: int, target: float | None = None):
    """``policy`` (Agent API) reset for B rows and advanced to episode step t; a function doing one step."""
    policy.reset(B) if target is None else policy.reset(B, target=target)
    obs, rew = np.random.default_rng(0).normal(size=(B, state_dim)).astype(np.float32), np.ones(B, np.float32)
    policy.act(obs)
    for _ in range(t - 1):
        policy.act(obs, rew)
    return lambda: policy.act(obs, rew)


def hf_step(hf, cfg, B: int, K: int):
    """One HuggingFace recompute step on K steps of history for B rows (model call only), in the model's dtype."""
    g = torch.Generator().manual_seed(0)
    dt = next(hf.parameters()).dtype
    s, a = torch.randn(B, K, cfg.state_dim, generator=g).to(dt), torch.rand(B, K, cfg.act_dim, generator=g).to(dt)
    r, R = torch.zeros(B, K, 1, dtype=dt), torch.randn(B, K, 1, generator=g).to(dt)
    tt = torch.arange(K).expand(B, K).contiguous()
    am = torch.ones(B, K, dtype=torch.long)

    def step():
        with torch.inference_mode():
            out = hf(states=s, actions=a, rewards=r, returns_to_go=R, timesteps=tt, attention_mask=am,
                     return_dict=True)
            return out.action_preds[:, -1].float().numpy()
    return step


def ratios(ms: dict) -> dict:
    """slow / fast for every recompute baseline over every stream path present, and the torch stream over
    each other stream path."""
    streams = [p for p in STREAM_PATHS if p in ms]
    out = {f"{slow}/{fast}": ms[slow] / ms[fast] for slow in RECOMPUTE_PATHS if slow in ms for fast in streams}
    return out | {f"stream/{fast}": ms["stream"] / ms[fast] for fast in streams[1:]}


def policy(name: str, model, info, engine: str, K: int, B: int, found: dict, exports, threads=None, t=None, **kw):
    """One ``act`` of ``engine`` (an agent engine or an exported format) at (K, B), advanced to step ``t`` (K)."""
    if engine in found:  # an exported runtime takes its thread count when it is made
        p, target = found[engine](exports.path(name, model, K, engine), threads=threads), info.eval_targets[0]
    else:
        p, target = make_agent(with_context(model, K), info, engine, **kw), None
    return advanced(p, B, t or K, model.cfg.state_dim, target)


def latency_section(models: dict, info, bc: BenchConfig, found: dict, exports) -> dict:
    batches, contexts, ts = (int_list(bc, k) for k in ("batches", "contexts", "ts"))
    res = {}
    for name, model in models.items():
        res[name] = {}
        for K in contexts:
            hf = {"hf_recompute": hf_model(model.cfg, K)} if bc.hf else {}
            if bc.hf and bc.bf16:
                hf["hf_recompute_bf16"] = hf_model(model.cfg, K, torch.bfloat16)
            for B in batches:
                fns = {"stream": policy(name, model, info, "stream", K, B, found, exports)}
                for engine in (*found, "recompute"):
                    fns[engine] = policy(name, model, info, engine, K, B, found, exports, threads=bc.threads)
                fns.update({k: hf_step(m, model.cfg, B, K) for k, m in hf.items()})
                ms = timing.median_ms(fns, bc.calls, bc.rounds)
                streams = {p: ms[p] for p in STREAM_PATHS if p in ms}
                best = min(streams, key=streams.get)
                exact = min((p for p in streams if p in EXACT_PATHS), key=streams.get)
                e = {"K": K, "batch": B, "ms": ms, "ratios": ratios(ms), "best_stream": best, "best_exact": exact}
                if hf:
                    e["hf_over_best"], e["hf_over_best_exact"] = ms["hf_recompute"] / ms[best], ms["hf_recompute"] / ms[exact]
                res[name][f"K{K}_B{B}"] = e
                print(f"{name} K={K:4d} batch={B:4d}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
                      + "\n    " + ", ".join(f"{k} {v:.1f}x" for k, v in e["ratios"].items())
                      + (f"; HF / best exact stream ({exact}) {e['hf_over_best_exact']:.1f}x, HF / best stream "
                         f"({best}) {e['hf_over_best']:.1f}x" if hf else ""), flush=True)
    name, model = next(iter(models.items()))
    for B in batches:  # stream latency versus episode step t: flat, the state does not grow
        ms = timing.median_ms({f"t{t}": policy(name, model, info, "stream", contexts[0], B, found, exports, t=t)
                               for t in ts}, bc.calls, bc.rounds)
        e = res[name][f"stream_vs_t_B{B}"] = {"batch": B, "ms": ms, "max_over_min": max(ms.values()) / min(ms.values())}
        print(f"{name} stream batch={B:4d} vs t: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
              + f"  (max/min {e['max_over_min']:.2f})", flush=True)
    return res


@contextlib.contextmanager
def competing_process():
    """One CPU-bound process (a Python busy loop) running beside the measurement, stopped afterwards."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        time.sleep(0.2)  # let it start spinning
        yield p.pid
    finally:
        p.kill()
        p.wait()


def threads_once(name: str, model, info, K: int, bc: BenchConfig, found: dict, exports) -> dict:
    """ms per act for every engine, batch and thread setting (the runtime's default, 1, 2, the policy's), as
    the machine is; the settings of one engine and batch interleaved round by round."""
    out = {}
    try:
        for engine in ("stream", "recompute", *found):
            for B in (1, 100):
                counts = {"default": None, "1": 1, "2": 2, "policy": inference_threads(engine, B)}
                fns, torch_threads = {}, {k: n or TORCH_DEFAULT_THREADS for k, n in counts.items()}
                for setting, n in counts.items():
                    torch.set_num_threads(torch_threads[setting])
                    fns[setting] = policy(name, model, info, engine, K, B, found, exports, threads=n)
                row = timing.median_ms(fns, bc.calls, bc.rounds,
                                       before={k: (lambda n=n: torch.set_num_threads(n)) for k, n in torch_threads.items()})
                row.update(policy_threads=counts["policy"], policy_over_1=row["policy"] / row["1"],
                           default_threads=TORCH_DEFAULT_THREADS if engine != "onnx" else "OnnxPolicy default",
                           default_over_1=row["default"] / row["1"])
                out[f"{engine}_B{B}"] = row
    finally:
        torch.set_num_threads(bc.threads)
    return out


def threads_section(models: dict, info, bc: BenchConfig, found: dict, exports) -> dict:
    name, model = next(iter(models.items()))
    K = int_list(bc, "contexts")[0]
    res = {"size": name, "K": K, "cores": usable_cores(), "torch_default_threads": TORCH_DEFAULT_THREADS}
    for cond in ("idle", "compete") if bc.compete else ("idle",):
        with competing_process() if cond == "compete" else contextlib.nullcontext():
            res[cond] = threads_once(name, model, info, K, bc, found, exports)
        print(f"threads ({name}, K={K}, {'beside one busy process' if cond == 'compete' else 'machine as it is'}; "
              f"ms per act, default = {TORCH_DEFAULT_THREADS} torch threads):", flush=True)
        for key, row in res[cond].items():
            print(f"  {key:16s} " + "  ".join(f"{s} {row[s]:9.3f}" for s in ("default", "1", "2", "policy"))
                  + f"   (policy = {row['policy_threads']} thread(s): {row['policy_over_1']:.2f}x of one thread)",
                  flush=True)
    return res


def bf16_skipped(bc: BenchConfig) -> str | None:
    """Why the bf16 path is left out (None: they run). Without native bfloat16 matmuls oneDNN emulates
    them, so they time the emulation, not bf16, and take long enough to stall a whole run."""
    if not bc.bf16:
        return "bf16=false"
    if bc.bf16_emulated or native_bf16("cpu"):
        return None
    return ("this CPU has no native bfloat16 matmuls (AVX512-BF16 or AMX): they would be emulated, far slower than "
            "fp32; bf16_emulated=true runs them anyway")


def tables(report: dict) -> list[list[str]]:
    """The Markdown tables of a report: latency, threads, evaluation (the sections it ran)."""
    out, engines = [], [*STREAM_PATHS, *RECOMPUTE_PATHS]
    lat = [(size, e) for size, entries in report["latency"].items() for k, e in entries.items() if k[0] == "K"]
    if lat:
        cols = [p for p in engines if any(p in e["ms"] for _, e in lat)]
        out.append(timing.table(["size", "K", "batch", *[f"{c} ms" for c in cols], "HF / best exact", "HF / best"],
                                [[s, e["K"], e["batch"], *[f"{e['ms'][c]:.3g}" if c in e["ms"] else "" for c in cols],
                                  *[f"{e[k]:.1f}x" if k in e else "" for k in ("hf_over_best_exact", "hf_over_best")]]
                                 for s, e in lat]))
    th = report.get("threads")
    if th:
        out.append(timing.table(["engine, batch", "condition", "default", "1 thread", "2 threads", "policy"],
                                [[key.replace("_B", ", batch "), cond, *[f"{row[k]:.3g}" for k in ("default", "1", "2")],
                                  f"{row['policy']:.3g} ({row['policy_threads']} thread(s))"]
                                 for cond in ("idle", "compete") for key, row in th.get(cond, {}).items()]))
    ev = report.get("evaluation")
    if ev:
        out.append(timing.table(["evaluator", f"seconds for {ev['episodes']} episodes", "x faster than sequential"],
                                [[k, f"{v:.2f}", f"{ev['speedup_by_layout'][k]:.1f}"]
                                 for k, v in ev["vectorized_by_layout_s"].items()]
                                + [["sequential recompute", f"{ev['sequential_recompute_s']:.1f}", "1.0"]]))
    return out


def run(argv: list[str]) -> dict:
    from primal_dt.run.cli import parse

    bc = parse(BenchConfig, argv, prog=PROG,
               description="Every way to run a DT policy side by side: latency, threads, evaluation wall time.")
    with errors.setup_errors():
        check(bc)
        models, info, trained = build_models(bc)
    runtime.set_threads(bc.threads)
    keep_freed_memory()
    found, skipped = exported_runtimes(bc)
    for fmt, why in skipped.items():
        print(f"skipping the {fmt} runtime: {why}", flush=True)
    no_bf16 = bf16_skipped(bc)
    if no_bf16 is not None:
        bc = dataclasses.replace(bc, bf16=False)
        if no_bf16 != "bf16=false":
            print(f"skipping the bf16 path (hf_recompute_bf16): {no_bf16}", flush=True)
    machine = timing.machine(PROG, argv) | {"torch_default_threads": TORCH_DEFAULT_THREADS}
    print(f"models: {', '.join(f'{k} {m.layer_names}' for k, m in models.items())}; torch {torch.__version__}, "
          f"{bc.threads} thread(s) (torch default {TORCH_DEFAULT_THREADS}), {machine['cores']} cores, {machine['cpu']}",
          flush=True)
    report = {"machine": machine, "torch_threads": bc.threads, "config": dataclasses.asdict(bc), "sizes": list(models),
              "exported": {"formats": sorted(found), "skipped": skipped}, "bf16_skipped": no_bf16}
    exports = Exports(info) if found else None
    try:
        report["latency"] = latency_section(models, info, bc, found, exports) if bc.latency else {}
        if bc.thread_table:
            report["threads"] = threads_section(models, info, bc, found, exports)
        if exports is not None:
            report["exported"]["export_s"] = exports.export_s
    finally:
        if exports is not None:
            exports.dir.cleanup()
    if bc.episodes > 0:
        report["evaluation"] = evaluation_section(trained if trained is not None else next(iter(models.values())), info, bc)
    timing.write(report, bc.json, bc.markdown, "Acting speed: stream, ONNX, TorchScript, recompute and HuggingFace"
                 f" (ms per act; {bc.threads} torch thread(s) outside the threads table)", tables(report))
    return report


def main(argv=None) -> dict:
    """``python -m eval.bench.inference``: bad options or checkpoints end as every entry point's (errors.main)."""
    return errors.main(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
