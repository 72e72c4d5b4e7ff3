"""Where primal+dt's training step departs on a device: one initialisation, one set of batches drawn
up front, dropout 0, the same steps taken in every form and precision of the step (the arms), each against the
arm it adds one thing to, and all against eager float32.

    python -m eval.bench.diagnose --device cuda --budget_s 200 --json diag.json --markdown diag.md  # a GPU; --budget_s bounds it
    python -m eval.bench.diagnose --size tiny --steps 30 --backend aot_eager --data_source d4rl:FILE  # a rehearsal

The arms, each with its parent (what it adds): eager fp32 (the reference); eager bf16 (bf16 autocast); aot_eager
bf16 (torch.compile's traced forward and backward without inductor, the fused AdamW that skips a failed step on
the device); compile bf16 and compile fp32 (inductor's kernels); cudagraphs bf16 and cudagraphs fp32 (the step
captured in a CUDA graph); cudagraphs bf16 with cuBLAS's reduced-precision bf16 reductions off (its parent with
them on). A yardstick arm, eager float64 over the first steps, measures how far float32 rounding alone moves the
reference; eager bf16 is bf16's.

Per arm: the loss at a few steps, the optimizer steps applied against those taken (a compiled step skips a
non-finite one on the device, and every later one), the first failed step, the relative parameter distance
||theta - theta_ref|| / ||theta_ref - theta_0|| from eager fp32 and from its parent at steps 1, 10, 100 and the
last, and the validation action MSE at the end (the run's held-out episodes). An arm departs from its parent
where its distance at step 1 or 10 exceeds ``agents.compile_check.FACTOR`` times its precision's yardstick,
where it applied fewer steps than it took, or where its validation MSE is more than ``VAL_FACTOR`` times its
parent's. The arm that departs first (earliest, then fewest additions) names the part of the step to blame.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from agents import compile_check, train_config, training
from agents.train_step import Stepper
from primal_dt.run import errors, options, runtime

from . import timing
from .train import SIZES


class Arm(NamedTuple):
    name: str
    mode: str
    amp: str
    parent: str
    adds: str
    backend: str = ""
    """torch.compile's backend ('': the run's ``--backend``)"""
    reduced: bool = True
    """cuBLAS's reduced-precision bf16 reductions allowed (PyTorch's default)"""


ARMS = (
    Arm("eager fp32", "eager", "off", "", "the reference"),
    Arm("eager bf16", "eager", "bf16", "eager fp32", "bf16 autocast"),
    Arm("aot_eager bf16", "compile", "bf16", "eager bf16", "torch.compile's traced step (AOT autograd, no inductor) "
        "and the fused AdamW that skips on the device", backend="aot_eager"),
    Arm("compile bf16", "compile", "bf16", "aot_eager bf16", "inductor's kernels (bf16)"),
    Arm("compile fp32", "compile", "off", "eager fp32", "torch.compile with inductor's kernels (fp32)"),
    Arm("cudagraphs bf16", "cudagraphs", "bf16", "compile bf16", "the CUDA graph capture (bf16)"),
    Arm("cudagraphs fp32", "cudagraphs", "off", "compile fp32", "the CUDA graph capture (fp32)"),
    Arm("cudagraphs bf16 exact-reductions", "cudagraphs", "bf16", "cudagraphs bf16",
        "cuBLAS's reduced-precision bf16 reductions turned off (its parent departs by them where this does not)",
        reduced=False),
)
BY_NAME = {a.name: a for a in ARMS}
AT = (1, 10, 100)
"""steps whose parameter distances are kept (and the last)"""
EARLY = (1, 10)
"""steps whose distances are held against the yardstick (later, rounding's differences have grown chaotic)"""
VAL_FACTOR = 1.5
"""a validation MSE this many times the parent's departs"""


@dataclass
class DiagnoseConfig(timing.Outputs):
    device: str = "auto"
    """auto | cpu | cuda | cuda:N"""
    size: Literal["paper", "tiny"] = "paper"
    """paper (width 256, 4 heads, 3 layers, s 64, K 20, batch 64: the recipe's) | tiny (width 32, 2 heads, 2 layers,
    s 8, K 5, batch 8: a rehearsal)"""
    steps: int = 1000
    """steps per arm"""
    warmup: int = 100
    """learning-rate warm-up steps (the recipe's lr 1e-3 reached early, where the GPU's bf16 runs failed)"""
    env: str = "hopper-medium"
    """the dataset's environment"""
    data_source: str = "replica"
    """where the data comes from (``data_source=`` of primal_dt.train)"""
    seed: int = 0
    """the initialisation, the batches and the held-out episodes"""
    arms: tuple[str, ...] = tuple(a.name for a in ARMS)
    """arms to run (eager fp32, the reference, always runs)"""
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile's backend of the compile and cudagraphs arms (aot_eager or eager: a rehearsal without inductor's
    minutes of compilation on a CPU)"""
    threads: int = 1
    """torch threads (0: torch's default)"""
    budget_s: float = 0.0
    """at most this many seconds in all: each arm gets an equal share of what is left and stops stepping when it is
    spent (its steps taken say so); no arm starts after it (0: no limit)"""


PROG = "python -m eval.bench.diagnose"
NUMBERS = {"steps": options.AT_LEAST_1, "warmup": options.AT_LEAST_0, "threads": options.THREADS,
           "budget_s": options.Range(0, 1e6), "seed": options.AT_LEAST_0}


def check(args: DiagnoseConfig) -> None:
    unknown = [a for a in args.arms if a not in BY_NAME]
    if unknown:
        raise ValueError(f"--arms: no arm named {', '.join(map(repr, unknown))}; the arms: "
                         + ", ".join(repr(a.name) for a in ARMS))
    runtime.pick_device(args.device, option="--device")


def prepare(args: DiagnoseConfig) -> training.Run:
    """The recipe's run (its model initialised by the seed, its data, sampler and held-out validation), dropout 0,
    no evaluation in a simulator; nothing written."""
    size = SIZES[args.size]
    small = {"K": 5, "batch_size": 8} if args.size == "tiny" else {}
    argv = [f"env={args.env}", f"data_source={args.data_source}", "model=primal+dt", "model.dropout=0",
            f"model.d_model={size['d_model']}", f"model.n_heads={size['n_heads']}",
            f"model.n_layers={size['n_layers']}", f"model.s={size['s']}", f"seed={args.seed}",
            f"device={args.device}", f"threads={args.threads}",
            f"steps={args.steps}", f"warmup_steps={args.warmup}", "eval.every=0", "eval.final_episodes=0",
            "compile=eager", *(f"{k}={v}" for k, v in small.items())]
    return training.prepare(train_config.build(argv))


def run_arm(arm: Arm, run: training.Run, data, backend: str, limit_s: float, dtype=torch.float32) -> dict:
    """One arm's steps from the run's initialisation (in ``dtype``; the validation only in float32); {loss,
    applied, taken, failed, snapshots, val_mse, seconds}."""
    cfg = run.cfg
    model = copy.deepcopy(run.model).to(dtype).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=arm.mode != "eager")
    w = cfg.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / w) if w else 1.0)
    autocast = torch.bfloat16 if arm.amp == "bf16" else None
    kw = {} if arm.mode == "eager" else {"backend": arm.backend or backend}
    cuda = run.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(run.device)) if cuda else (lambda: None)
    keep = {*AT, len(data)}
    losses, snaps = {}, {}
    from torch._dynamo import config as dynamo

    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(dynamo.patch(recompile_limit=64))  # each arm compiles Stepper._loss anew
        if cuda and not arm.reduced:
            matmul = torch.backends.cuda.matmul
            was = matmul.allow_bf16_reduced_precision_reduction
            matmul.allow_bf16_reduced_precision_reduction = False
            stack.callback(setattr, matmul, "allow_bf16_reduced_precision_reduction", was)
        stack.enter_context(torch.random.fork_rng(devices=[run.device] if cuda else []))
        stepper = Stepper(arm.mode, model, params, opt, sched, cfg.eta, cfg.grad_clip, autocast=autocast, **kw)
        taken = 0
        for i, b in enumerate(data, 1):
            if dtype != torch.float32:
                b = type(b)(*(v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in b))
            out = stepper.step(b)
            taken = i
            if i in keep or i % max(1, len(data) // 4) == 0:
                losses[i] = float(out[0])  # a read-back in the compiled forms
            if i in keep:
                snaps[i] = [p.detach().double().clone() for p in params]
            if (stepper.eager or i % 25 == 0) and time.perf_counter() - t0 > limit_s:
                sync()
                if time.perf_counter() - t0 > limit_s:
                    break
        sync()
    failed = stepper.failure()
    state = opt.state.get(params[0], {}).get("step")
    val = run.validation.action_mse(model) if run.validation is not None and dtype == torch.float32 else math.nan
    return {"arm": arm.name, "loss": losses, "taken": taken, "applied": int(state) if state is not None else 0,
            "failed": failed.step if failed is not None else None, "snaps": snaps, "val_mse": val,
            "seconds": round(time.perf_counter() - t0, 1)}


def distances(res: dict, other: dict, start: list[torch.Tensor]) -> dict[int, float]:
    """{step: relative parameter distance of ``res`` from ``other``} at the steps both kept."""
    return {s: compile_check.distance(res["snaps"][s], other["snaps"][s], start)
            for s in sorted(res["snaps"]) if s in other["snaps"]}


def departure(arm: Arm, res: dict, results: dict, dist: dict, yard: dict) -> tuple[float, str] | None:
    """(when: step, or steps + 1 for skipped steps, steps + 2 for validation; what) where ``arm`` departs from its
    parent, or None."""
    parent = results.get(arm.parent)
    if parent is None:
        return None
    mine = dist[arm.name]["parent"]
    # eager bf16's own distance is bf16's yardstick: it departs from eager fp32 only by its steps or validation
    scale = {} if arm.name == "eager bf16" else yard["bf16"] if arm.amp == "bf16" else yard["fp32"]
    for s in EARLY:
        if s in mine and s in scale and not mine[s] <= max(compile_check.FACTOR * scale[s], compile_check.FLOOR):
            return s, (f"at step {s}: distance {mine[s]:.2g} from {arm.parent}, rounding explains "
                       f"{compile_check.FACTOR * scale[s]:.2g}")
    last = max(res["taken"], 1)
    if res["applied"] < res["taken"] and parent["applied"] == parent["taken"]:
        return last + 1, f"applied {res['applied']} of {res['taken']} steps (first failed: {res['failed']})"
    if res["taken"] != parent["taken"]:  # a budget cut one short: their validations are not comparable
        return None
    if not res["val_mse"] <= VAL_FACTOR * parent["val_mse"] and not math.isnan(parent["val_mse"]):  # NaN departs
        return last + 2, f"validation MSE {res['val_mse']:.4g} against {arm.parent}'s {parent['val_mse']:.4g}"
    return None


def main(argv: list[str] | None = None) -> dict:
    args, argv = timing.parse(DiagnoseConfig, argv, PROG, __doc__, NUMBERS, check=check)
    with errors.setup_errors():
        run = prepare(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = run.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    data = [training.next_batch(run)[0] for _ in range(args.steps)]
    print(f"training-step diagnosis on {device} ({name}; torch {torch.__version__}): primal+dt {args.size}, "
          f"{args.steps} steps per arm, dropout 0, one initialisation, {len(data)} batches drawn up front", flush=True)
    t0 = time.perf_counter()
    deadline = t0 + (args.budget_s or math.inf)
    wanted = [a for a in ARMS if a.name == "eager fp32" or a.name in args.arms]
    skipped = [f"{a.name} (needs CUDA)" for a in wanted if a.mode == "cudagraphs" and device.type != "cuda"]
    wanted = [a for a in wanted if not (a.mode == "cudagraphs" and device.type != "cuda")]
    start = [p.detach().double().clone() for p in run.model.parameters()]
    results, yard = {}, {}
    for k, arm in enumerate(wanted):
        left = deadline - time.perf_counter()
        if results and left <= 0:
            skipped += [f"{a.name} (--budget_s spent)" for a in wanted[k:]]
            break
        res = run_arm(arm, run, data, args.backend, left / (len(wanted) - k))
        results[arm.name] = res
        print(f"  {arm.name}: {res['taken']} steps in {res['seconds']}s, applied {res['applied']}, "
              f"validation MSE {res['val_mse']:.4g}", flush=True)
        if arm.name == "eager fp32":
            # float32 rounding's own distance: the reference in float64 over the early steps
            yard["fp32"] = distances(run_arm(arm, run, data[:max(EARLY)], args.backend, math.inf, torch.float64),
                                     res, start)
    ref = results["eager fp32"]
    if "eager bf16" in results:
        yard["bf16"] = distances(results["eager bf16"], ref, start)
    yard.setdefault("bf16", {})
    dist = {k: {"eager fp32": distances(r, ref, start),
                "parent": distances(r, results[BY_NAME[k].parent], start) if BY_NAME[k].parent in results else {}}
            for k, r in results.items()}
    departs = {}
    for k, r in results.items():
        d = departure(BY_NAME[k], r, results, dist, yard)
        if d is not None:
            departs[k] = d
    order = [a.name for a in ARMS]
    first = min(departs, key=lambda k: (departs[k][0], order.index(k))) if departs else None
    verdict = (f"departs first: {first} ({departs[first][1]}); the part it adds to {BY_NAME[first].parent}: "
               f"{BY_NAME[first].adds}" if first else
               f"no arm departs from its parent (distances at steps {', '.join(map(str, EARLY))} within "
               f"{compile_check.FACTOR:g}x rounding's, every step applied, validation MSE within {VAL_FACTOR:g}x)")
    rows = []
    for k, r in results.items():
        arm = BY_NAME[k]
        rows.append([k, arm.parent or "-", " ".join(f"{s}:{v:.4g}" for s, v in sorted(r["loss"].items())),
                     f"{r['applied']}/{r['taken']}", r["failed"] or "-",
                     " ".join(f"{s}:{v:.2g}" for s, v in dist[k]["eager fp32"].items()),
                     " ".join(f"{s}:{v:.2g}" for s, v in dist[k]["parent"].items()) or "-",
                     f"{r['val_mse']:.4g}", departs[k][1] if k in departs else "-", r["seconds"]])
    out = {"machine": timing.machine(PROG, argv), "device": str(device), "size": args.size, "steps": args.steps,
           "arms": {k: {key: v for key, v in r.items() if key != "snaps"} | {"distance": dist[k]}
                    for k, r in results.items()},
           "yardstick": yard, "departs": {k: v[1] for k, v in departs.items()}, "first": first, "verdict": verdict,
           "skipped": skipped, "seconds": round(time.perf_counter() - t0, 1)}
    notes = [verdict, f"yardstick (rounding's distance from eager fp32): fp32 (eager float64) "
             + " ".join(f"{s}:{v:.2g}" for s, v in yard["fp32"].items()) + "; bf16 (eager bf16) "
             + (" ".join(f"{s}:{v:.2g}" for s, v in yard["bf16"].items()) or "-")]
    if skipped:
        notes.append("skipped: " + ", ".join(skipped))
    timing.write(out, args.json, args.markdown, f"Training-step diagnosis on {device} ({name}): primal+dt "
                 f"{args.size}, {args.steps} steps per arm ({out['seconds']:.0f}s)",
                 [timing.table(["arm", "parent", "loss at step", "applied/taken", "first failed",
                                "distance from eager fp32", "distance from parent", "val MSE", "departs", "s"], rows)],
                 notes)
    return out


if __name__ == "__main__":
    main()
