"""Inference benchmark: every way to run a Decision-Transformer policy, side by side, in one run.

    python -m eval.bench.inference checkpoint=runs/compare/hopper-medium/primal+dt/<run>/last.pt \\
        seq_episodes=25 json=bench-inference.json                      # everything (a few minutes)
    python -m eval.bench.inference episodes=0 thread_table=false       # latency only, random models
    python -m eval.bench.inference latency=false thread_table=false    # the evaluation only

Every ratio printed is taken inside this run, on this machine, so it compares like with like. The
bench measures and reports; what a figure should be is for the reader (and the commit comparing two
checkouts) to judge:

1. **latency** (per ``act``, one environment step for every row), for each model size in ``sizes``
   (width x heads, 3 layers: ``256x4`` the papers' DT runs, ``128x1`` the original DT; a size equal to
   the checkpoint's uses its weights, others random weights of ``layout``), each context K in
   ``contexts`` and each batch in ``batches``:
   - ``stream``: ``agents.Agent(engine="stream").act`` (bookkeeping included);
   - ``stream_bf16``: the same with ``precision="bf16"`` (bfloat16 weight matmuls: not exact, so
     ``bf16_max_da`` reports its largest action difference from ``stream`` in the same state; ``bf16=false``
     leaves it out, and so does a CPU without native bfloat16 matmuls, where they are emulated, unless
     ``bf16_emulated=true``);
   - ``onnx`` / ``torchscript``: the stream step exported by ``agents.export`` and run by
     ``agents.onnx_policy.OnnxPolicy`` (onnxruntime) / ``agents.torchscript_policy.TorchScriptPolicy``, same
     ``Agent`` API (skipped, with the reason printed, where agents.export or onnxruntime is missing);
   - ``recompute``: ``Agent(engine="recompute")`` with a full K-step context;
   - ``hf_recompute``: HuggingFace ``DecisionTransformerModel`` (same sizes, random weights: latency
     only) as its documentation uses it: the model on the last K steps, ``action_preds[:, -1]``;
     ``hf_recompute_bf16``: the same model in bfloat16 (with ``bf16``), so that bf16 is also compared
     with bf16.
   Ratios: slow / fast for every recompute baseline over every stream path, and HF (float32) over the
   best exact stream path and over the best stream path of any precision. Then the stream latency at
   episode steps ``ts`` (flat: its state does not grow).
2. **threads** (first size, first K): each engine at batch 1 and 100 with the runtime's default
   threads, 1, 2, and ``agents.threads.inference_threads``' choice, on the machine as it is and
   (``compete=true``) beside one CPU-bound process the bench starts itself.
3. **evaluation** (``eval/bench/evaluator.py``): ``episodes`` Hopper episodes, vectorised stream
   evaluator vs the sequential recompute loop, and where each one's time goes.

Timings on a shared CPU are noisy: each latency is the median over ``rounds`` rounds, settings
interleaved within a round, each round about 0.2 s (at least one call) per setting.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import platform
import statistics
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
from primal_dt.run import errors, options, runtime
from primal_dt.attention.precision import native_bf16

RANDOM_MODEL_ENV = "hopper-medium"
"""the dataset whose dimensions, simulator and targets the random models (no checkpoint) take"""
STREAM_PATHS = ("stream", "stream_bf16", "onnx", "torchscript")
EXACT_PATHS = ("stream", "onnx", "torchscript")
"""the stream paths that reproduce the model's float32 actions (to 1e-5)"""
RECOMPUTE_PATHS = ("recompute", "hf_recompute", "hf_recompute_bf16")
ROUND_S = 0.2
TORCH_DEFAULT_THREADS = torch.get_num_threads()
"""torch's own thread count in this process before anything set it (its default: the physical cores)"""


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
    cold caches: few calls per round inflate the fast paths' latencies, by 10-20% at 30 calls)"""
    rounds: int = 5
    """rounds, settings interleaved; a latency is the median over rounds"""
    latency: bool = True
    """run the latency section"""
    exported: bool = True
    """include the exported runtimes (ONNX, TorchScript) in the latency and threads sections"""
    hf: bool = True
    """include the HuggingFace baseline (needs `transformers`)"""
    bf16: bool = True
    """include the stream engine with precision=bf16 (and HF in bfloat16) in the latency section, on a CPU with
    native bfloat16 matmuls (AVX512-BF16 or AMX)"""
    bf16_emulated: bool = False
    """run the bf16 paths on a CPU without native bfloat16 too (emulated: far slower than fp32, minutes per size)"""
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
    if bc.json:
        options.check_output_file(bc.json, "json")


# -- models -----------------------------------------------------------------------------------------
def random_model(info, width: int, heads: int, layout: str, seed: int):
    """A random DT of the given size, 3 layers, on the dimensions of ``info``'s environment."""
    import envs
    from agents.decision_transformer import DecisionTransformer, DTConfig

    spec = envs.get_spec(info.env)
    torch.manual_seed(seed)
    s = min(64, width // heads)
    return DecisionTransformer(DTConfig(state_dim=spec.obs_dim, act_dim=spec.act_dim, K=20, d_model=width, n_heads=heads,
                                        n_layers=3, name=layout, s=s, dropout=0.0)).eval()


def build_models(bc: BenchConfig):
    """({size name: model}, DataInfo, the checkpoint's model or None). Without a checkpoint the data
    bookkeeping is hopper-medium's with identity statistics and the papers' reward scale."""
    from agents import dt_checkpoint
    from agents.train_config import TrainConfig

    trained = None
    if bc.checkpoint:
        ck = dt_checkpoint.load(bc.checkpoint)
        trained, info = ck.build_model(), ck.data
    else:
        import envs

        spec = envs.get_spec(RANDOM_MODEL_ENV)
        info = dt_checkpoint.DataInfo(env=spec.name, state_mean=np.zeros(spec.obs_dim),
                                      state_std=np.ones(spec.obs_dim), reward_scale=TrainConfig.reward_scale,
                                      targets=spec.targets, source="random model")
    sizes = [parse_size(s) for s in bc.sizes]
    if not sizes:
        sizes = [(trained.cfg.d_model, trained.cfg.n_heads)] if trained is not None else [(256, 4)]
    models = {}
    for w, h in sizes:
        if trained is not None and (trained.cfg.d_model, trained.cfg.n_heads) == (w, h):
            models[f"{w}x{h}"] = trained
        else:
            models[f"{w}x{h}"] = random_model(info, w, h, bc.layout, bc.seed)
    return models, info, trained


def with_context(model, K: int):
    """The same weights with context length K (K is not a parameter: it sets recompute's context and
    the stream's softmax cache)."""
    m = copy.copy(model)  # shares the modules and parameters
    m.cfg = dataclasses.replace(model.cfg, K=K)
    return m


def hf_model(cfg, K: int, dtype=torch.float32):
    try:
        from transformers import DecisionTransformerConfig, DecisionTransformerModel
        from transformers.utils import logging as hf_logging
    except ImportError as err:
        raise errors.SetupError("the HuggingFace baseline needs `transformers` (a benchmark-only extra): "
                                 "pip install 'primal-dt[bench]' (keeps torch as it is), or run with hf=false") from err
    hf_logging.set_verbosity_error()
    c = DecisionTransformerConfig(state_dim=cfg.state_dim, act_dim=cfg.act_dim, hidden_size=cfg.d_model,
                                  n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=int(cfg.mlp_ratio * cfg.d_model),
                                  activation_function=cfg.activation, max_ep_len=cfg.max_timestep,
                                  n_positions=max(1024, 3 * K), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return DecisionTransformerModel(c).eval().to(dtype)


# -- exported runtimes ------------------------------------------------------------------------------
def exported_runtimes(bc: BenchConfig) -> tuple[dict, dict]:
    """({format: policy class}, {format: why it is skipped}) for the exported runtimes available here."""
    if not bc.exported:
        return {}, {f: "exported=false" for f in ("onnx", "torchscript")}
    try:
        from agents.export import export_policy  # noqa: F401
        from agents.torchscript_policy import TorchScriptPolicy
    except ImportError as err:
        why = f"agents.export is not available ({err})"
        return {}, {"onnx": why, "torchscript": why}
    found, skipped = {"torchscript": TorchScriptPolicy}, {}
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401

        from agents.onnx_policy import OnnxPolicy

        found["onnx"] = OnnxPolicy
    except ImportError as err:
        skipped["onnx"] = f"onnx / onnxruntime missing ({err}): pip install 'primal-dt[export]'"
    return found, skipped


class Exports:
    """Exported artefacts of the benchmarked models, one per (size, K, format), made on first use into a
    temporary directory (``agents.export.export_policy`` of an in-memory checkpoint)."""

    def __init__(self, info):
        self.info = info
        self.dir = Path(tempfile.mkdtemp(prefix="bench-inference-"))
        self.paths: dict = {}
        self.export_s: dict = {}

    def path(self, size: str, model, K: int, fmt: str) -> Path:
        key = (size, K, fmt)
        if key not in self.paths:
            from agents.dt_checkpoint import DTCheckpoint
            from agents.export import FORMATS, export_policy

            ck = DTCheckpoint(model_config=dataclasses.replace(model.cfg, K=K), model=model.state_dict(),
                              data=self.info, origin="benchmark model")
            t0 = time.perf_counter()
            self.paths[key] = export_policy(ck, format=fmt, out=self.dir / f"{size}-K{K}-{FORMATS[fmt]}")
            self.export_s[f"{size}-K{K}-{fmt}"] = time.perf_counter() - t0
        return self.paths[key]

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


# -- timing -----------------------------------------------------------------------------------------
def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def _nothing() -> None:
    pass


def median_ms(fns: dict, calls: int, rounds: int, round_s: float = ROUND_S, before: dict | None = None) -> dict:
    """Interleaved rounds: every round times each function once (up to ``calls`` calls, fewer for
    slow ones so a round takes about ``round_s``); the median round per function, in ms. ``before``:
    {name: what to run, untimed, before that function's calls} (e.g. set its thread count)."""
    out = {k: [] for k in fns}
    n = {}
    before = before or {}
    for k, f in fns.items():
        before.get(k, _nothing)()
        f()  # warm-up
        t0 = time.perf_counter()
        f()
        one = time.perf_counter() - t0
        n[k] = max(1, min(calls, int(round_s / max(one, 1e-6))))
    for _ in range(rounds):
        for k, f in fns.items():
            before.get(k, _nothing)()
            out[k].append(timed(f, n[k]))
    return {k: statistics.median(v) for k, v in out.items()}


def advanced(policy, B: int, t: int, state_dim: int, target: float | None = None):
    """``policy`` (Agent API) reset for B rows and advanced to episode step t; a function doing one step."""
    policy.reset(B) if target is None else policy.reset(B, target=target)
    g = np.random.default_rng(0)
    obs = g.normal(size=(B, state_dim)).astype(np.float32)
    rew = np.ones(B, np.float32)
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
    """slow / fast for every recompute baseline over every stream path present, the torch stream over each
    exported runtime, and HF over the best stream path."""
    out = {}
    streams = [p for p in STREAM_PATHS if p in ms]
    for slow in RECOMPUTE_PATHS:
        for fast in streams:
            if slow in ms:
                out[f"{slow}/{fast}"] = ms[slow] / ms[fast]
    for fast in streams[1:]:
        out[f"stream/{fast}"] = ms["stream"] / ms[fast]
    return out


def bf16_max_da(model, info, K: int, B: int, steps: int = 50) -> float:
    """Largest |action difference| between the bf16 and the fp32 stream engines fed the same
    observations and rewards for ``steps`` steps from the start of B episodes (observations drawn
    around the data's mean, so the inputs look like the simulator's)."""
    a32, a16 = (make_agent(model, info, "stream", precision=p) for p in ("fp32", "bf16"))
    g = np.random.default_rng(0)
    worst, rew = 0.0, None
    for a in (a32, a16):
        a.reset(B)
    for _ in range(steps):
        obs = (info.state_mean + info.state_std * g.normal(size=(B, len(info.state_mean)))).astype(np.float32)
        worst = max(worst, float(np.abs(a32.act(obs, rew) - a16.act(obs, rew)).max()))
        rew = g.normal(size=B).astype(np.float32)
    return worst


def policies(name: str, model, info, K: int, B: int, bc: BenchConfig, found: dict, exports: Exports | None,
             threads: int | None = None) -> dict:
    """{engine: one-step function} for every engine of the latency table at (K, B); ``threads`` goes to
    the exported runtimes (None: their own default)."""
    mk = with_context(model, K)
    c, target = model.cfg, info.eval_targets[0]
    fns = {"stream": advanced(make_agent(mk, info, "stream"), B, K, c.state_dim)}
    if bc.bf16:
        fns["stream_bf16"] = advanced(make_agent(mk, info, "stream", precision="bf16"), B, K, c.state_dim)
    for fmt, cls in found.items():
        fns[fmt] = advanced(cls(exports.path(name, model, K, fmt), threads=threads), B, K, c.state_dim, target)
    fns["recompute"] = advanced(make_agent(mk, info, "recompute"), B, K, c.state_dim)
    return fns


def latency_section(models: dict, info, bc: BenchConfig, found: dict, exports: Exports | None) -> dict:
    batches, contexts, ts = (int_list(bc, k) for k in ("batches", "contexts", "ts"))
    res = {}
    for name, model in models.items():
        res[name] = {}
        for K in contexts:
            hf = hf_model(model.cfg, K) if bc.hf else None
            hf16 = hf_model(model.cfg, K, torch.bfloat16) if bc.hf and bc.bf16 else None
            for B in batches:
                fns = policies(name, model, info, K, B, bc, found, exports, threads=bc.threads)
                if hf is not None:
                    fns["hf_recompute"] = hf_step(hf, model.cfg, B, K)
                if hf16 is not None:
                    fns["hf_recompute_bf16"] = hf_step(hf16, model.cfg, B, K)
                ms = median_ms(fns, bc.calls, bc.rounds)
                streams = {p: ms[p] for p in STREAM_PATHS if p in ms}
                best = min(streams, key=streams.get)
                exact = min((p for p in streams if p in EXACT_PATHS), key=streams.get)
                entry = {"K": K, "batch": B, "ms": ms, "ratios": ratios(ms), "best_stream": best, "best_exact": exact}
                if "hf_recompute" in ms:
                    entry["hf_over_best"] = ms["hf_recompute"] / ms[best]
                    entry["hf_over_best_exact"] = ms["hf_recompute"] / ms[exact]
                if "stream_bf16" in ms:
                    entry["bf16_max_da"] = bf16_max_da(with_context(model, K), info, K, B)
                res[name][f"K{K}_B{B}"] = entry
                print(f"{name} K={K:4d} batch={B:4d}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()),
                      flush=True)
                print("    " + ", ".join(f"{k} {v:.1f}x" for k, v in entry["ratios"].items())
                      + (f"; HF / best exact stream ({exact}) {entry['hf_over_best_exact']:.1f}x, HF / best stream "
                         f"({best}) {entry['hf_over_best']:.1f}x" if "hf_over_best" in entry else "")
                      + (f"; bf16 max |da| {entry['bf16_max_da']:.1e}" if "bf16_max_da" in entry else ""), flush=True)
    name, model = next(iter(models.items()))
    mk = with_context(model, contexts[0])
    for B in batches:  # stream latency versus episode step t: flat, the state does not grow
        fns = {f"t{t}": advanced(make_agent(mk, info, "stream"), B, t, model.cfg.state_dim) for t in ts}
        ms = median_ms(fns, bc.calls, bc.rounds)
        res[name][f"stream_vs_t_B{B}"] = {"batch": B, "ms": ms, "max_over_min": max(ms.values()) / min(ms.values())}
        print(f"{name} stream batch={B:4d} vs t: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
              + f"  (max/min {res[name][f'stream_vs_t_B{B}']['max_over_min']:.2f})", flush=True)
    return res


# -- threads --------------------------------------------------------------------------------------------
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


THREAD_SETTINGS = ("default", "1", "2", "policy")


def thread_counts(engine: str, B: int) -> dict:
    """setting -> threads to ask for (None: the runtime's own default)."""
    return {"default": None, "1": 1, "2": 2, "policy": inference_threads(engine, B)}


def threads_once(name: str, model, info, K: int, bc: BenchConfig, found: dict, exports: Exports | None) -> dict:
    """ms per act for every engine, batch and thread setting (see ``thread_counts``), as the machine is. The
    settings of one engine and batch are interleaved round by round (torch's count is set before each)."""
    out = {}
    mk = with_context(model, K)
    c, target = model.cfg, info.eval_targets[0]
    try:
        for engine in ("stream", "recompute", *found):
            for B in (1, 100):
                counts = thread_counts(engine, B)
                fns, torch_threads = {}, {}
                for setting, n in counts.items():
                    torch_threads[setting] = n or TORCH_DEFAULT_THREADS
                    torch.set_num_threads(torch_threads[setting])
                    if engine in found:  # an exported runtime takes its thread count when it is made
                        fns[setting] = advanced(found[engine](exports.path(name, model, K, engine), threads=n), B, K,
                                                c.state_dim, target)
                    else:
                        fns[setting] = advanced(make_agent(mk, info, engine), B, K, c.state_dim)
                ms = median_ms(fns, bc.calls, bc.rounds,
                               before={k: (lambda n=n: torch.set_num_threads(n)) for k, n in torch_threads.items()})
                row = dict(ms)
                row["policy_threads"] = counts["policy"]
                row["default_threads"] = TORCH_DEFAULT_THREADS if engine != "onnx" else "OnnxPolicy default"
                row["policy_over_1"] = row["policy"] / row["1"]
                row["default_over_1"] = row["default"] / row["1"]
                out[f"{engine}_B{B}"] = row
    finally:
        torch.set_num_threads(bc.threads)
    return out


def threads_section(models: dict, info, bc: BenchConfig, found: dict, exports: Exports | None) -> dict:
    name, model = next(iter(models.items()))
    K = int_list(bc, "contexts")[0]
    res = {"size": name, "K": K, "cores": usable_cores(), "torch_default_threads": TORCH_DEFAULT_THREADS}
    conditions = ["idle", "compete"] if bc.compete else ["idle"]
    for cond in conditions:
        with competing_process() if cond == "compete" else contextlib.nullcontext():
            res[cond] = threads_once(name, model, info, K, bc, found, exports)
        print(f"threads ({name}, K={K}, {'beside one busy process' if cond == 'compete' else 'machine as it is'}; "
              f"ms per act, default = {TORCH_DEFAULT_THREADS} torch threads):", flush=True)
        for key, row in res[cond].items():
            print(f"  {key:16s} " + "  ".join(f"{s} {row[s]:9.3f}" for s in THREAD_SETTINGS)
                  + f"   (policy = {row['policy_threads']} thread(s): {row['policy_over_1']:.2f}x of one thread)",
                  flush=True)
    return res


# -- the run ----------------------------------------------------------------------------------------------
def bf16_skipped(bc: BenchConfig) -> str | None:
    """Why the bf16 paths are left out (None: they run). Without native bfloat16 matmuls oneDNN emulates
    them, so they time the emulation, not bf16, and take long enough to stall a whole run."""
    if not bc.bf16:
        return "bf16=false"
    if bc.bf16_emulated or native_bf16("cpu"):
        return None
    return ("this CPU has no native bfloat16 matmuls (AVX512-BF16 or AMX): they would be emulated, far slower than "
            "fp32; bf16_emulated=true runs them anyway")


def run(argv: list[str]) -> dict:
    from primal_dt.run.cli import parse

    bc = parse(BenchConfig, argv, prog="python -m eval.bench.inference",
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
            print(f"skipping the bf16 paths (stream_bf16, hf_recompute_bf16): {no_bf16}", flush=True)
    print(f"models: {', '.join(f'{k} {m.layer_names}' for k, m in models.items())}; torch {torch.__version__}, "
          f"{bc.threads} thread(s) (torch default {TORCH_DEFAULT_THREADS}), {usable_cores()} cores, "
          f"{platform.processor() or platform.machine()}", flush=True)
    report = {"machine": {"cores": usable_cores(), "torch": torch.__version__,
                          "torch_default_threads": TORCH_DEFAULT_THREADS, "processor": platform.processor()},
              "torch_threads": bc.threads, "config": dataclasses.asdict(bc), "sizes": list(models),
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
            exports.close()
    if bc.episodes > 0:
        model = trained if trained is not None else next(iter(models.values()))
        report["evaluation"] = evaluation_section(model, info, bc)
    if bc.json:
        with open(bc.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"report: {bc.json}")
    return report


def main(argv=None) -> dict:
    """``python -m eval.bench.inference``: bad options or checkpoints end as every entry point's (errors.main)."""
    return errors.main(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
