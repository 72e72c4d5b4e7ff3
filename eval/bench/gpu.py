"""The GPU benchmark: what a Decision Transformer costs on one accelerator, ratios in one run.

    python -m eval.bench.gpu                        # on a GPU: bounded by --budget_s
    python -m eval.bench.gpu --budget               # tiny sizes, any device: a rehearsal in seconds

Its three parts (ms per update, act latency, trainings at once) are described in docs/gpu.md.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from agents.train_step import default_mode
from primal_dt.run import options, runtime

from . import timing
from .train import ACT_DIM, OURS, SIZES, STATE_DIM, HuggingFace, Ours, batches

TINY = dict(d_model=32, n_heads=2, n_layers=2, s=8)
"""``--budget``'s model size (a rehearsal of every part, in seconds on a CPU)"""
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
BASELINE = "dt eager fp32"
D3RLPY_MS = 5.96
"""d3rlpy's DT, ms per update on a GPU at batch 64, K 20 (its published benchmark); a figure from
elsewhere, on another GPU: a reference line, not a ratio of this run"""


def timed(step, data: list[dict], device: torch.device) -> float:
    """ms per call of ``step`` over ``data`` (the device synchronised before and after, once)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for b in data:
        step(b)
    sync()
    return 1000 * (time.perf_counter() - t0) / len(data)


# -- 1. ms per update ----------------------------------------------------------------------------------
def updates(args, device: torch.device, size: dict, skipped: list[str]) -> dict[str, float]:
    """{"layout form precision": ms per update}; what ``args.deadline`` leaves no time for goes to ``skipped``."""
    n = args.steps
    data = [b.to(device) for b in batches(2 * args.warmup + 2 * n, args.batch, args.K)]
    forms = ["eager", "compile"] + (["cudagraphs"] if device.type == "cuda" else [])
    out = {}
    for precision, dtype in PRECISIONS.items():
        if precision == "bf16" and not args.bf16:
            continue
        for layout in OURS:
            if out and time.perf_counter() > args.deadline:  # the baseline (the first) always runs
                skipped.append(f"{layout} {precision}")
                continue
            torch.manual_seed(0)
            eager = Ours(layout, size, args.K, "eager", str(device), autocast=dtype)
            timed(eager.step, data[: args.warmup], device)
            out[f"{layout} eager {precision}"] = timed(eager.step, data[args.warmup: args.warmup + n], device)
            torch.manual_seed(0)
            # one compiled step, timed first as it is, then captured whole in a CUDA graph
            comp = Ours(layout, size, args.K, forms[-1], str(device), graph_after=args.warmup + n, autocast=dtype,
                        backend=args.backend)
            t0 = time.perf_counter()
            timed(comp.step, data[: args.warmup], device)
            print(f"  {layout} {precision}: compiled in {time.perf_counter() - t0:.0f}s", flush=True)
            out[f"{layout} compile {precision}"] = timed(comp.step, data[args.warmup: args.warmup + n], device)
            if "cudagraphs" in forms:
                rest = data[args.warmup + n:]
                timed(comp.step, rest[:2], device)  # the capture
                out[f"{layout} cudagraphs {precision}"] = timed(comp.step, rest[2:], device)
            print("  " + ", ".join(f"{k} {v:.2f} ms" for k, v in out.items() if k.startswith(layout + " ")
                                   and k.endswith(precision)), flush=True)
        if args.hf and time.perf_counter() > args.deadline:
            skipped.append(f"hf-dt {precision}")
        elif args.hf:
            torch.manual_seed(0)
            hf = HuggingFace(size, args.K, str(device), autocast=dtype)
            timed(hf.step, data[: args.warmup], device)
            out[f"hf-dt eager {precision}"] = timed(hf.step, data[args.warmup: args.warmup + n], device)
    return out


# -- 2. act latency ------------------------------------------------------------------------------------
def act_latency(args, device: torch.device, size: dict) -> dict[str, float]:
    """{"act batch B": ms per act} of the stream agent (primal+dt) on ``device``: each act brings its action back
    to the host, so it ends synchronised."""
    from agents.decision_transformer import DecisionTransformer, DTConfig
    from agents.dt_checkpoint import DataInfo

    from .inference import policy

    torch.manual_seed(0)
    cfg = DTConfig(state_dim=STATE_DIM, act_dim=ACT_DIM, K=args.K, name="primal+dt", dropout=0.0, **size)
    model = DecisionTransformer(cfg).to(device).eval()
    info = DataInfo(env="hopper-medium", state_mean=np.zeros(STATE_DIM, np.float32),
                    state_std=np.ones(STATE_DIM, np.float32), reward_scale=1000.0, targets=(3600.0,))
    acts = {f"act batch {batch}": policy(model, info, "stream", args.K, batch, {}, t=5) for batch in (1, 100)}
    return timing.median_ms(acts, args.acts, 1)


# -- 3. concurrent trainings ---------------------------------------------------------------------------
def worker(args, device: torch.device, size: dict, go: Path) -> None:
    """One of the concurrent trainings: warm up (compile), say ready, wait for ``go``, time, print JSON."""
    mode = default_mode(device)
    runner = Ours("primal+dt", size, args.K, mode, str(device))
    data = [b.to(device) for b in batches(args.warmup + 3 + args.steps, args.batch, args.K)]
    timed(runner.step, data[: args.warmup + 3], device)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.01)
    print(json.dumps({"ms_per_update": timed(runner.step, data[args.warmup + 3:], device), "mode": mode}), flush=True)


def concurrent(args, device: torch.device, n: int) -> dict:
    """N processes training at once (``worker``): each one's ms per update, and updates/s summed."""
    with tempfile.TemporaryDirectory() as tmp:
        go = Path(tmp) / "go"
        cmd = [sys.executable, "-m", "eval.bench.gpu", "--worker", str(go), "--device", str(device),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)] \
            + (["--budget"] if args.budget else [])
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
        try:
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a concurrent training did not start (exit {p.wait()})")
            go.touch()
            results = [json.loads(p.stdout.readline()) for p in procs]
        finally:
            for p in procs:
                p.wait(timeout=600)
    ms = [r["ms_per_update"] for r in results]
    return {"processes": n, "mode": results[0]["mode"], "ms_per_update_median": statistics.median(ms),
            "updates_per_s": sum(1000 / m for m in ms)}


# -- the run -------------------------------------------------------------------------------------------
PROG = "python -m eval.bench.gpu"


@dataclass
class GpuBenchConfig(timing.Outputs):
    device: str = "auto"
    """auto | cpu | cuda | cuda:N"""
    budget: bool = False
    """tiny sizes and few steps, for a rehearsal on any device in seconds (and the tests)"""
    steps: int = 50
    """timed updates per form"""
    warmup: int = 5
    """untimed updates first (compilation falls here)"""
    bf16: bool = True
    """also time bf16 autocast"""
    no_hf: bool = False
    """skip HuggingFace's DT even when transformers is installed"""
    threads: int = 0
    """torch CPU threads per process (0: runtime's default)"""
    budget_s: float = 240.0
    """start no new part after this many seconds (those left out are named under the table; 0: no limit), so a
    run stays within about 5 minutes on a GPU however long its compilations take"""
    worker: str = ""
    """(internal) run as one of the concurrent trainings, starting when this file appears"""


NUMBERS = {"steps": options.AT_LEAST_1, "warmup": options.AT_LEAST_1, "threads": options.THREADS,
           "budget_s": options.Range(0, 1e6)}


def main(argv: list[str] | None = None) -> dict:
    args, argv = timing.parse(GpuBenchConfig, argv, PROG, __doc__, NUMBERS,
                              check=lambda a: runtime.pick_device(a.device, option="--device"))
    device = runtime.pick_device(args.device)
    runtime.set_threads(args.threads)
    size = TINY if args.budget else SIZES["paper"]
    # segments per update, their length K, timed acts per batch size, trainings at once against one alone
    args.batch, args.K, args.acts, args.concurrent = (8, 5, 10, 2) if args.budget else (64, 20, 200, 6)
    if args.budget:
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 2)
    # eager compiles in seconds: a CPU rehearsal runs the compiled form's code without inductor's minutes
    args.backend = "eager" if args.budget and device.type == "cpu" else "inductor"
    if args.worker:
        worker(args, device, size, Path(args.worker))
        return {}
    args.hf = not args.no_hf and importlib.util.find_spec("transformers") is not None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"GPU benchmark on {device} ({name}), torch {torch.__version__}; size {size}, batch {args.batch}, "
          f"K {args.K}{', budget (a rehearsal)' if args.budget else ''}", flush=True)
    t0 = time.perf_counter()
    args.deadline = t0 + (args.budget_s or math.inf)
    skipped: list[str] = []
    ms = updates(args, device, size, skipped)
    acts = act_latency(args, device, size)
    conc = {}
    if time.perf_counter() < args.deadline:
        conc = {"one": concurrent(args, device, 1), "many": concurrent(args, device, args.concurrent)}
    else:
        skipped.append("concurrent trainings")
    res = {"device": str(device), "name": name, "torch": torch.__version__, "size": size, "batch": args.batch,
           "K": args.K, "budget": args.budget, "ms_per_update": ms, "act_ms": acts, "concurrent": conc,
           "skipped": skipped, "seconds": round(time.perf_counter() - t0, 1), "machine": timing.machine(PROG, argv)}
    base = ms[BASELINE]
    notes = [f"(d3rlpy DT, published, its GPU): {D3RLPY_MS:.2f} ms, x {base / D3RLPY_MS:.2f}"] \
        if not args.budget and device.type == "cuda" else []
    notes.append("stream agent act (primal+dt): " + ", ".join(f"{k} {v:.2f} ms" for k, v in acts.items()))
    if c := conc:
        notes.append(f"{c['many']['processes']} trainings at once ({c['many']['mode']}): "
                     f"{c['many']['updates_per_s']:.0f} updates/s in all vs {c['one']['updates_per_s']:.0f} alone "
                     f"(x {c['many']['updates_per_s'] / c['one']['updates_per_s']:.2f}); each "
                     f"{c['many']['ms_per_update_median']:.2f} ms per update vs {c['one']['ms_per_update_median']:.2f}")
    if skipped:
        notes.append("not measured (--budget_s reached): " + ", ".join(skipped))
    rows = [[k, f"{v:.2f}", f"{base / v:.2f}"] for k, v in sorted(ms.items(), key=lambda kv: kv[1])]
    timing.write(res, args.json, args.markdown, f"ms per update on {device} ({name}), batch {args.batch}, K {args.K}, "
                 f"width {size['d_model']}; {res['seconds']:.0f}s",
                 [timing.table(["model form precision", "ms", f"x {BASELINE}"], rows)], notes)
    return res


if __name__ == "__main__":
    main()
