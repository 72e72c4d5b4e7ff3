"""Attention benchmark: training cost versus length, and recurrent step latency versus context.

    python -m eval.bench.attention                       # LRA width (64, 2 heads), batch 8
    python -m eval.bench.attention --lengths 256,1024,4096,16384 --markdown docs/results/attention.md
    python -m eval.bench.attention --mechanisms softmax primal:s=20,data_dependent=true linear performer
    python -m eval.bench.attention --all --lengths 256,1024,4096     # every registered mechanism

Part 1: forward+backward of one layer and its peak memory; part 2: single-token steps of a recurrent state
prefilled with t tokens, at batch 1 (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from primal_dt.run import cli, options

from . import timing

# The LRA setting of the Primal-Attention paper: PrimalFormer s=20, data-dependent projections.
DEFAULT_MECHANISMS = ["softmax", "softmax:impl=materialized", "primal:s=20,data_dependent=true"]
CAUSAL_MECHANISMS = ["softmax", "softmax:impl=materialized", "primal:s=20"]


def all_specs(max_len: int) -> tuple[list[str], list[str], list[str]]:
    """Every registered mechanism, split by the directions and forms it supports."""
    from primal_dt.attention import available, get_class

    bidir, causal, step = list(DEFAULT_MECHANISMS), list(CAUSAL_MECHANISMS), ["softmax", "primal:s=20"]
    for name in available():
        if name in ("softmax", "primal"):
            continue
        cls = get_class(name)  # linformer's and cosformer's tables are sized by max_len
        spec = f"{name}:max_len={max_len}" if name in ("linformer", "cosformer") else name
        if cls.supports_bidirectional:
            bidir.append(spec)
        if cls.supports_causal:
            causal.append(spec)
            if cls.supports_step:
                step.append(spec)
    return bidir, causal, step


def build(spec: str, width: int, heads: int, causal: bool):
    """A layer from ``name:key=value,...`` (values read as attention options are: ``options.attention_options``)."""
    from primal_dt.attention import build_attention

    name, _, rest = spec.partition(":")
    opts = options.attention_options([f"{name}.{kv}" for kv in rest.split(",") if kv], "mechanism spec")
    return build_attention(name, width, heads, causal=causal, **opts.get(name, {}))


def child(job: dict) -> dict:
    """Runs in a fresh process: time fwd+bwd, report peak RSS above the RSS before the first call (a CPU has no
    allocator counter torch exposes)."""
    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    layer = build(job["spec"], job["width"], job["heads"], job["causal"])
    x = torch.randn(job["batch"], job["length"], job["width"], requires_grad=True)
    base = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20  # RSS, MB
    times = []
    for _ in range(job["repeat"] + 1):
        t0 = time.perf_counter()
        y, _ = layer(x)
        y.sum().backward()
        times.append(time.perf_counter() - t0)
        x.grad = None
        layer.zero_grad(set_to_none=True)
        if time.perf_counter() - t0 > job["budget_s"]:
            break
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"ms": 1e3 * statistics.median(times[1:] or times), "peak_mb": max(peak - base, 0.0)}


CHILD = "import json, sys; from eval.bench.attention import child; print(json.dumps(child(json.load(sys.stdin))))"
"""What a child process runs: the job comes on stdin, so the command line keeps only the user's options."""


def run_child(job: dict, timeout: float) -> dict:
    try:
        out = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(job), capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"over {timeout:.0f}s"}
    if out.returncode != 0:
        err = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"skipped": f"failed: {err[:80]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def part1(args) -> list[dict]:
    rows = []
    for causal, specs in ((False, args.mechanisms), (True, args.causal_mechanisms)):
        for n in args.lengths:
            for spec in specs:
                job = dict(spec=spec, width=args.width, heads=args.heads, causal=causal, batch=args.batch,
                           length=n, repeat=args.repeat, threads=args.threads, budget_s=args.budget_s)
                row = {"part": "train", "mechanism": spec, "causal": causal, "length": n, "batch": args.batch}
                # the canonical form holds the score matrix, its softmax and their gradients, float32
                if "materialized" in spec and 16.0 * args.batch * args.heads * n * n > args.mem_limit_gb * 2**30:
                    row["skipped"] = f"needs > {args.mem_limit_gb} GB"
                else:
                    row.update(run_child(job, args.timeout))
                rows.append(row)
                what = f"{spec:<34} {'causal' if causal else 'bidir ':<6} N={n:>6}"
                print(f"  train {what}: skipped ({row['skipped']})" if "skipped" in row else
                      f"  train {what}: {row['ms']:9.1f} ms  {row['peak_mb']:9.1f} MB", flush=True)
    return rows


@torch.no_grad()
def part2(args) -> list[dict]:
    rows, width = [], args.step_width
    for spec in args.step_mechanisms:
        for t in args.contexts:  # a softmax layer's cache: a ring that holds the whole context
            form = build(spec, width, args.step_heads, causal=True).eval().recurrent(window=t + 1, chunk=1024)
            state = form.init(1)
            for i in range(0, t, 1024):  # prefill in chunks
                _, state = form(torch.randn(1, min(1024, t - i), width), state)
            x = torch.randn(1, 1, width)
            us = 1e3 * timing.median_ms({spec: lambda: form(x, state)}, 1, args.step_repeat)[spec]
            rows.append({"part": "step", "mechanism": spec, "context": t, "us": us})
            print(f"  step  {spec:<34} context {t:>6}: {us:8.1f} us", flush=True)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Every mechanism against both softmax forms at each direction and length (> 1: the target is faster,
    or smaller)."""
    idx = {(r["mechanism"], r["causal"], r["length"]): r for r in rows if r["part"] == "train" and "ms" in r}
    out = []
    for (mech, causal, n), r in sorted(idx.items()):
        for base in ("softmax", "softmax:impl=materialized"):
            if mech not in ("softmax", "softmax:impl=materialized") and (base, causal, n) in idx:
                b = idx[(base, causal, n)]
                out.append({"target": mech, "baseline": base, "causal": causal, "length": n,
                            "speedup": b["ms"] / r["ms"], "memory_ratio": b["peak_mb"] / max(r["peak_mb"], 0.1)})
    return out


NUMBERS = {k: options.AT_LEAST_1 for k in ("lengths", "batch", "width", "heads", "contexts", "step_width",
                                           "step_heads", "step_repeat", "repeat", "threads")}
NUMBERS.update({"budget_s": options.SECONDS, "timeout": options.SECONDS, "mem_limit_gb": options.POSITIVE})


@dataclass
class AttentionBenchConfig(timing.Outputs):
    lengths: tuple[int, ...] = (256, 1024, 4096)
    """sequence lengths of part 1 (forward+backward)"""
    batch: int = 8
    """sequences per batch in part 1"""
    width: int = 64
    """layer width in part 1"""
    heads: int = 2
    """heads in part 1"""
    mechanisms: tuple[str, ...] = field(default=tuple(DEFAULT_MECHANISMS), metadata=cli.SPACED)
    """bidirectional specs, e.g. --mechanisms softmax primal:s=20,data_dependent=true linear"""
    causal_mechanisms: tuple[str, ...] = field(default=tuple(CAUSAL_MECHANISMS), metadata=cli.SPACED)
    """causal specs timed in part 1"""
    step_mechanisms: tuple[str, ...] = field(default=("softmax", "primal:s=20"), metadata=cli.SPACED)
    """recurrent specs timed in part 2"""
    contexts: tuple[int, ...] = (10, 100, 1000, 10000)
    """prefilled tokens before the timed steps of part 2"""
    step_width: int = 64
    """layer width in part 2"""
    step_heads: int = 2
    """heads in part 2"""
    step_repeat: int = 200
    """timed single-token steps per context"""
    repeat: int = 3
    """timed forward+backward passes per configuration (after a warm-up)"""
    threads: int = 1
    """torch CPU threads"""
    budget_s: float = 20.0
    """stop repeating a configuration after this many seconds"""
    timeout: float = 300.0
    """seconds before a configuration's child process is given up"""
    mem_limit_gb: float = 12.0
    """skip the materialised softmax where its attention matrices would need more GB than this"""
    all: bool = False
    """every registered mechanism (overrides the lists)"""
    skip_train: bool = False
    """skip part 1"""


PROG = "python -m eval.bench.attention"


def parse_args(argv=None) -> tuple[AttentionBenchConfig, list[str]]:
    return timing.parse(AttentionBenchConfig, argv, PROG, __doc__, NUMBERS)


def main(argv=None) -> dict:
    args, argv = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.all:
        args.mechanisms, args.causal_mechanisms, args.step_mechanisms = all_specs(max(args.lengths + args.contexts))
    print(f"torch {torch.__version__}, {args.threads} thread(s); layer width {args.width}, {args.heads} heads, "
          f"batch {args.batch}; fwd+bwd median of {args.repeat} after warm-up")
    rows = ([] if args.skip_train else part1(args)) + part2(args)
    summary = ratios(rows)
    steps = [r for r in rows if r["part"] == "step"]
    res = {"machine": timing.machine(PROG, argv), "config": vars(args), "rows": rows, "ratios": summary}
    direction = lambda r: "causal" if r["causal"] else "bidirectional"  # noqa: E731
    train = [[r["mechanism"], direction(r), r["length"], r.get("skipped") or f"{r['ms']:.1f}",
              "" if "skipped" in r else f"{r['peak_mb']:.1f}"] for r in rows if r["part"] == "train"]
    tables = [timing.table(["mechanism", "direction", "N", "fwd+bwd ms", "peak MB"], train)] if train else []
    tables += [timing.table(["target", "baseline", "direction", "N", "x faster", "x less memory"],
                            [[s["target"], s["baseline"], direction(s), s["length"], f"{s['speedup']:.1f}",
                              f"{s['memory_ratio']:.1f}"] for s in summary])] if summary else []
    tables += [timing.table(["mechanism", "context", "step us"], [[r["mechanism"], r["context"], f"{r['us']:.1f}"]
                                                                  for r in steps])] if steps else []
    timing.write(res, args.json, args.markdown, f"One attention layer: time and memory (batch {args.batch}, width "
                 f"{args.width}, {args.heads} heads; steps at width {args.step_width})", tables)
    return res


if __name__ == "__main__":
    main()
