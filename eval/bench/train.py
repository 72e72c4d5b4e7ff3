"""Decision Transformer training-step benchmark: our dt / primal+dt / primalformer-dt against
HuggingFace ``transformers.DecisionTransformerModel`` at the same sizes, in the same run, on any device.

    python -m eval.bench.train                                   # paper and original-DT sizes
    python -m eval.bench.train --sizes paper --rounds 5 --json bench-train.json --markdown docs/results/training-step.md
    python -m eval.bench.train --device cuda --sizes paper --compile eager compile cudagraphs --amp off bf16 \
        --steps 25 --rounds 2 --warmup 5 --act_calls 200 --budget_s 240         # a GPU, within about 5 minutes
    python -m eval.bench.train --sizes tiny --batch 8 --K 5 --steps 1 --rounds 2 --warmup 1 --compile eager compile \
        --amp off bf16 --backend eager --act_calls 10 --no-hf                   # a rehearsal on any device, in seconds

A step is what training does: forward on K-step segments (batch 64, K = 20), masked action MSE (+ eta *
KSVD for primal layers), backward, grad-norm clip 0.25, AdamW, dropout 0.1, on synthetic batches with the
sampler's shapes and padding (timing does not depend on values), the same for every model. On a shared CPU
load drifts, so the models take turns, ``--steps`` timed steps each per round; a figure is the median over
all of a model's steps (and the fastest: load only ever adds time). On CUDA a step only queues its work, so
a round's steps are timed as one, the device synchronised at both ends. ``transformers`` is the ``bench``
extra.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F

from agents.decision_transformer import Batch, DecisionTransformer, DTConfig
from agents.stream_training import first_exact_step, stream_exact_batch, stream_exact_config
from agents.train_step import GRAPH_WARMUP, Stepper
from primal_dt.run import errors, options, runtime

from . import timing
from .hf import hf_config
from .inference import act_latency

SIZES = {"paper": dict(d_model=256, n_heads=4, n_layers=3, s=64), "original": dict(d_model=128, n_heads=1, n_layers=3, s=64),
         "tiny": dict(d_model=32, n_heads=2, n_layers=2, s=8)}
OURS = ("dt", "primal+dt", "primalformer-dt")
HF = "hf:DecisionTransformerModel"
PRECISIONS = {"off": None, "bf16": torch.bfloat16}
STATE_DIM, ACT_DIM, ETA, CLIP = 11, 3, 0.05, 0.25
D3RLPY_MS = 5.96
"""d3rlpy's DT, ms per update at batch 64, K 20: its published benchmark, on its own GPU"""


def batches(n: int, batch: int, K: int, seed: int = 0) -> list[Batch]:
    """Segments shaped like envs.SegmentSampler's, about 1 in 10 right-padded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.where(torch.rand(batch, generator=g) < 0.1,
                              torch.randint(1, K + 1, (batch,), generator=g), torch.full((batch,), K))
        mask = torch.arange(K)[None] < lengths[:, None]
        m = mask[..., None].float()
        out.append(Batch(states=torch.randn(batch, K, STATE_DIM, generator=g) * m,
                         actions=(torch.rand(batch, K, ACT_DIM, generator=g) * 2 - 1) * m,
                         rtg=torch.rand(batch, K, 1, generator=g) * 3.6 * m,
                         timesteps=(torch.randint(0, 980, (batch, 1), generator=g) + torch.arange(K)) * mask,
                         mask=mask, trailing=True))
    return out


class Ours:
    """Our DT's training step in a mode of ``agents.train_step.MODES`` (eager: the reference), more ``Stepper``
    options in ``stepper``."""

    def __init__(self, layout: str, size: dict, K: int, mode: str = "eager", device: str = "cpu", window: int = 0,
                 whole: bool = False, impl: str = "auto", **stepper):
        cfg = DTConfig(state_dim=STATE_DIM, act_dim=ACT_DIM, K=K, name=layout, dropout=0.1, **size,
                       attention_options=() if impl == "auto" else (f"softmax.impl={impl}",))
        self.first = None
        if window:  # stream-exact training (agents.stream_training): every layer windowed, the loss masked to exact steps
            cfg = stream_exact_config(cfg, window)
            self.first = first_exact_step(cfg)
        self.model = DecisionTransformer(cfg).to(device).train()
        self.K = K
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=1e-4, fused=mode != "eager")
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0)
        self.stepper = Stepper(mode, self.model, self.params, self.opt, self.sched, ETA, CLIP, **stepper)
        self.whole, self.state = whole, None

    def step(self, b: Batch) -> None:
        if self.whole:  # whole-episode training: each batch a chunk carrying the stream state the one before left
            state = self.state or self.model.chunk_form().init(b.mask.shape[0], b.mask.device)
            self.state = self.stepper.step(b._replace(state=state))[2]["state"]
            return
        self.stepper.step(b if self.first is None else stream_exact_batch(b, self.first))


class HuggingFace:
    """transformers' DecisionTransformerModel with the same sizes, dropout 0.1, tanh head; its forward in
    ``autocast`` (a dtype) when given."""

    def __init__(self, size: dict, K: int, device: str = "cpu", autocast: torch.dtype | None = None):
        from transformers import DecisionTransformerModel

        cfg = hf_config(dict(size, state_dim=STATE_DIM, act_dim=ACT_DIM), K, 0.1)
        self.model = DecisionTransformerModel(cfg).to(device).train()
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=1e-4)
        self.autocast = torch.autocast(torch.device(device).type, dtype=autocast, enabled=autocast is not None)

    def step(self, b: Batch) -> None:
        with self.autocast:
            out = self.model(states=b.states, actions=b.actions, rewards=None, returns_to_go=b.rtg,
                             timesteps=b.timesteps, attention_mask=b.mask.long(), return_dict=True)
            loss = F.mse_loss(out.action_preds[b.mask], b.actions[b.mask])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()


def timed(step, data: list[Batch], device: torch.device) -> tuple[float, float]:
    """(wall, process CPU) seconds per call of ``step`` over ``data``; on CUDA the device is synchronised at both
    ends, since a step there only queues its work."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for b in data:
        step(b)
    sync(device)
    return (time.perf_counter() - t0) / len(data), (time.process_time() - c0) / len(data)


def makers(size: dict, args, device: torch.device) -> dict:
    """{model: what builds it}, in the order they are set up: for each precision of ``--amp``, each form of
    ``--compile`` of our layouts, then HuggingFace's (eager); then the stream-exact steps. The first, our eager
    float32 dt, is the reference of every ratio."""
    out = {}
    for amp in args.amp:
        for mode in args.compile:
            tags = ",".join(t for t in (mode, amp) if t not in ("eager", "off"))
            out |= {f"ours:{lay}{f'[{tags}]' if tags else ''}": partial(
                Ours, lay, size, args.K, mode, device, autocast=PRECISIONS[amp], backend=args.backend) for lay in OURS}
        if not args.no_hf:
            out[HF + ("" if amp == "off" else f"[{amp}]")] = partial(HuggingFace, size, args.K, device, PRECISIONS[amp])
    for amp in args.amp:  # the softmax layers' other implementations, in each precision
        for impl in (i for i in args.attention_impl if i != "auto"):
            tags = ",".join(t for t in (impl, amp) if t != "off")
            out |= {f"ours:{lay}[{tags}]": partial(Ours, lay, size, args.K, device=device, impl=impl,
                                                   autocast=PRECISIONS[amp]) for lay in OURS}
    for amp in args.amp:  # the ways to an exact stream, in each precision
        bf16 = "" if amp == "off" else f",{amp}"
        for w, k in window_arms(args):  # stream-exact training: every layer windowed, the loss on exact steps only
            tag = f"w={w}" if k == args.K else f"w={w},K={k}"
            out |= {f"ours:{lay}[{tag}{bf16}]": partial(Ours, lay, size, k, device=device, window=w,
                                                        autocast=PRECISIONS[amp]) for lay in OURS}
        if args.whole_episodes:  # whole-episode training: chunks carrying the stream's state
            out |= {f"ours:{lay}[whole{bf16}]": partial(Ours, lay, size, args.K, device=device, whole=True,
                                                        autocast=PRECISIONS[amp]) for lay in OURS}
    return out


def window_arms(args) -> list[tuple[int, int]]:
    """``--stream_window``'s arms as (W, K): ``W`` trains on the run's K, ``W:K`` on its own K (a wide window
    reaches past K = 20, so it needs longer segments to count as many steps)."""
    arms = []
    for spec in args.stream_window:
        w, sep, k = str(spec).partition(":")
        try:
            arm = (int(w), int(k) if sep else args.K)
        except ValueError:
            arm = (0, 0)
        if min(arm) < 1:
            raise ValueError(f"--stream_window {spec!r}: give W or W:K, whole numbers >= 1 (tokens per layer, steps "
                             "per segment), e.g. --stream_window 10 21:40")
        arms.append(arm)
    return arms


def base_of(key: str) -> str:
    """The step a form's ratio is against: a way to an exact stream (``w=``, ``whole``) or another softmax
    implementation (``sdpa``, ``materialized``) against its layout's standard step in the same precision, a precision
    or compiled form against the layout's eager float32 step."""
    layout, tags = key[: key.index("[")], key[key.index("[") + 1: -1].split(",")
    same_precision = tags[0].startswith(("w=", "whole", "sdpa", "materialized"))
    return f"{layout}[bf16]" if same_precision and "bf16" in tags else layout


def set_up(name: str, size: dict, args, device: torch.device, deadline: float, skipped: list[str]) -> dict:
    """{model: runner}, each built and warmed up in turn (compilation and a CUDA graph's capture fall here, the
    part whose time is hard to foresee); none is started after ``deadline`` (each named in ``skipped``) but the
    first, the reference."""
    from torch._dynamo import config as dynamo

    warm = {}  # per segment length K
    runners = {}
    for k, make in makers(size, args, device).items():
        if runners and time.perf_counter() > deadline:
            skipped.append(f"{name} {k}")
            continue
        torch.manual_seed(0)
        t0, runners[k] = time.perf_counter(), make()
        # each compiled model compiles Stepper._loss anew: past dynamo's limit of 8 the rest would run uncompiled
        K = getattr(runners[k], "K", args.K)
        if K not in warm:
            warm[K] = [b.to(device) for b in batches(max(args.warmup, GRAPH_WARMUP + 1), args.batch, K, seed=1)]
        with dynamo.patch(recompile_limit=64):
            for b in warm[K][: max(args.warmup, GRAPH_WARMUP + 1) if "cudagraphs" in k else args.warmup]:
                runners[k].step(b)  # a CUDA graph is captured after GRAPH_WARMUP steps
        if (s := time.perf_counter() - t0) >= 1:
            print(f"  [{name}] {k}: set up in {s:.0f}s", flush=True)
    return runners


def bench_size(name: str, size: dict, args, device: torch.device, deadline: float, skipped: list[str]) -> dict:
    runners = set_up(name, size, args, device, deadline, skipped)
    Ks = {k: getattr(r, "K", args.K) for k, r in runners.items()}  # each step's segment length
    data = {K: [b.to(device) for b in batches(args.rounds * args.steps, args.batch, K)] for K in set(Ks.values())}
    per = args.steps if device.type == "cuda" else 1  # a CPU step timed alone; a round's CUDA steps as one
    times, cpu = {k: [] for k in runners}, {k: [] for k in runners}  # wall and process seconds per step
    for rnd in range(args.rounds):
        for k, r in runners.items():
            for i in range(rnd * args.steps, (rnd + 1) * args.steps, per):
                wall, proc = timed(r.step, data[Ks[k]][i: i + per], device)
                times[k].append(wall)
                cpu[k].append(proc)
        print(f"  [{name}] after round {rnd + 1}/{args.rounds}, median ms/step: "
              + ", ".join(f"{k} {1000 * statistics.median(v):.2f}" for k, v in times.items()), flush=True)
    res = {"size": name, **size, "K": args.K, "batch": args.batch, "models": {}}
    for k, v in times.items():
        med = statistics.median(v)
        res["models"][k] = {"ms_per_step": round(1000 * med, 3), "ms_per_step_min": round(1000 * min(v), 3),
                            "K": Ks[k], "tokens_per_s": round(args.batch * 3 * Ks[k] / med), "cpu_ms_per_step": round(1000 * statistics.median(cpu[k]), 3),
                            "params": sum(p.numel() for p in runners[k].params), "timed_steps": args.rounds * args.steps}
    m = res["models"]
    pairs = {f"{lay} / dt (time)": (f"ours:{lay}", "ours:dt") for lay in OURS[1:]}
    pairs |= {"hf / ours dt (time; > 1: ours faster)": (HF, "ours:dt"),
              "hf / ours primal+dt (time)": (HF, "ours:primal+dt")}
    # each form of our step against its layout's (base_of)
    pairs |= {f"{k[5:]} / {base_of(k)[5:]} (time)": (k, base_of(k)) for k in m if k.startswith("ours:") and "[" in k}
    # the fastest step and the process's own CPU time: less of what another process's load on a shared CPU adds
    for key, field in (("ratios", "ms_per_step"), ("ratios_of_min", "ms_per_step_min"),
                       ("ratios_of_cpu_time", "cpu_ms_per_step")):
        res[key] = {label: round(m[a][field] / m[b][field], 3) for label, (a, b) in pairs.items() if a in m and b in m}
    return res


@dataclass
class TrainBenchConfig(timing.Outputs):
    sizes: tuple[Literal["paper", "original", "tiny"], ...] = ("paper", "original")
    """model sizes to time: paper (width 256, 4 heads, 3 layers, the Primal-Attention paper's) | original (width
    128, 1 head, 3 layers, the original DT's) | tiny (width 32, 2 heads, 2 layers: a rehearsal)"""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N"""
    batch: int = 64
    """segments per step"""
    K: int = 20
    """context length in environment steps"""
    steps: int = 3
    """timed steps per model per round"""
    rounds: int = 4
    """rounds, each timing every model in turn"""
    warmup: int = 2
    """untimed steps per model first (a cudagraphs step takes at least 4: its graph is captured in them)"""
    threads: int = 1
    """torch threads (0: torch's default)"""
    compile: tuple[Literal["eager", "compile", "cudagraphs"], ...] = ("eager",)
    """training-step forms to time (agents.train_step): eager (the reference) | compile (torch.compile; its
    compilation falls in the warm-up steps) | cudagraphs (the compiled step captured in a CUDA graph; CUDA only)"""
    amp: tuple[Literal["off", "bf16"], ...] = ("off",)
    """mixed precisions to time each form in: off (float32, the reference) | bf16 (``amp=bf16`` of
    ``primal_dt.train``: the forward and loss in bf16 autocast, which pays where bf16 matmuls are native)"""
    backend: Literal["inductor", "eager"] = "inductor"
    """torch.compile's backend of the compiled forms: eager runs their code without inductor's compilation (minutes
    on a CPU), for a rehearsal"""
    stream_window: tuple[str, ...] = ()
    """also time stream-exact training (``stream_window=W`` of ``primal_dt.train``: every layer windowed to W
    tokens, the loss on exact steps only) of each model beside its standard step, in each precision: one arm per
    ``W`` (on K-step segments) or ``W:K`` (on segments of its own K, as ``eval/fidelity_comparison.sh``'s
    ``21:40``)"""
    whole_episodes: bool = False
    """also time whole-episode training (``whole_episodes=true`` of ``primal_dt.train``: each batch a K-step chunk
    run through the stream's recurrent form from the state the one before left) of each model beside its standard
    step"""
    attention_impl: tuple[Literal["auto", "sdpa", "materialized"], ...] = ("auto",)
    """the softmax layers' implementation (``model.attention_options=softmax.impl=...`` of ``primal_dt.train``):
    each other than auto (the default: the T x T scores on a CPU for short sequences, SDPA elsewhere) is timed
    beside the default step of each model, in each precision, e.g. ``--attention_impl auto sdpa``"""
    act_calls: int = 0
    """also time the stream agent's act (primal+dt at the first size, batch 1 and 100) on the device, at most this
    many calls per batch size (0: do not)"""
    budget_s: float = 0.0
    """set up no model, nor start the act latency, after this many seconds (those left out are named under the
    table; 0: no limit), so a GPU run stays within its time however long its compilations take"""
    no_hf: bool = False
    """skip transformers' model"""


PROG = "python -m eval.bench.train"
NUMBERS = {"batch": options.AT_LEAST_1, "K": options.AT_LEAST_1, "steps": options.AT_LEAST_1,
           "rounds": options.AT_LEAST_1, "warmup": options.AT_LEAST_0, "threads": options.THREADS,
           "act_calls": options.AT_LEAST_0, "budget_s": options.Range(0, 1e6)}


def check(args: TrainBenchConfig) -> None:
    if "off" not in args.amp:
        raise ValueError("--amp must include off (the float32 step the ratios are against)")
    if "eager" not in args.compile:
        raise ValueError("--compile must include eager (the reference the ratios are against)")
    if not args.sizes:
        raise ValueError(f"--sizes names no size; give some of {', '.join(SIZES)}")
    window_arms(args)
    device = runtime.pick_device(args.device, option="--device")
    if "cudagraphs" in args.compile and device.type != "cuda":
        raise ValueError(f"--compile cudagraphs needs a CUDA device (--device={args.device} is {device}); leave it out")
    if not args.no_hf:
        try:
            hf_config(dict(SIZES["original"], state_dim=1, act_dim=1), 1, 0.0)
        except errors.SetupError as err:
            raise ValueError(f"{err} (or pass --no-hf)") from None


def parse_args(argv: list[str] | None = None) -> tuple[TrainBenchConfig, list[str]]:
    return timing.parse(TrainBenchConfig, argv, PROG, __doc__, NUMBERS, check=check)


def notes_of(results: dict, args, device: torch.device) -> list[str]:
    """What goes under the table: each size's ratios, d3rlpy's published figure (on CUDA at the paper's size), the
    act latency and what the time budget left out."""
    notes = [f"{r['size']}: " + "; ".join(f"{k} {v:.3f}" for k, v in r[key].items()) + f" ({what})"
             for r in results["results"] for key, what in
             (("ratios", "median step"), ("ratios_of_min", "fastest step, less sensitive to load"),
              ("ratios_of_cpu_time", "the process's CPU time, which others' load does not add"))]
    if device.type == "cuda" and "paper" in args.sizes:
        notes.append(f"reference, not a ratio of this run: d3rlpy publishes {D3RLPY_MS:.2f} ms per update for its DT "
                     "(batch 64, K 20) on its own GPU")
    if acts := results.get("act_ms"):
        notes.append("stream agent act (primal+dt): " + ", ".join(f"{k} {v:.2f} ms" for k, v in acts.items()))
    if results["skipped"]:
        notes.append("not measured (--budget_s reached): " + ", ".join(results["skipped"]))
    return notes


def run(argv: list[str]) -> dict:
    args, argv = parse_args(argv)
    device = runtime.pick_device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    results = {"machine": timing.machine(PROG, argv), "device": str(device), "results": [], "skipped": []}
    if not args.no_hf:
        import transformers

        results["transformers"] = transformers.__version__
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"DT training-step benchmark on {device} ({name}; torch {torch.__version__}, {torch.get_num_threads()} "
          f"thread(s)); {args.rounds} rounds x {args.steps} steps per model", flush=True)
    t0 = time.perf_counter()
    deadline = t0 + (args.budget_s or math.inf)
    rows = []
    for s in args.sizes:
        r = bench_size(s, SIZES[s], args, device, deadline, results["skipped"])
        results["results"].append(r)
        rows += [[f"{s} ({r['d_model']}, {r['n_heads']} heads)", k, f"{v['ms_per_step']:.2f}", f"{v['ms_per_step_min']:.2f}",
                  f"{v['ms_per_step'] / r['models']['ours:dt']['ms_per_step']:.2f}", f"{v['params']:,}"]
                 for k, v in r["models"].items()]
    if args.act_calls and time.perf_counter() > deadline:
        results["skipped"].append("act latency")
    elif args.act_calls:
        results["act_ms"] = act_latency(SIZES[args.sizes[0]], args, device)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    timing.write(results, args.json, args.markdown, f"Training step on {device}: our DT models"
                 f"{'' if args.no_hf else ' against HuggingFace'} (batch {args.batch}, K = {args.K}; median of "
                 f"{args.rounds * args.steps} steps per model, models in turns; {results['seconds']:.0f}s)",
                 [timing.table(["size", "model", "ms per step", "fastest step", "x ours:dt", "parameters"], rows)],
                 notes_of(results, args, device))
    return results


def main(argv: list[str] | None = None) -> dict:
    """``python -m eval.bench.train``: bad options and refused writes end as every entry point's (errors.main)."""
    return errors.main(run, argv)


if __name__ == "__main__":
    main()
