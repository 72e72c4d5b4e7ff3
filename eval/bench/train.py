"""Decision Transformer training-step benchmark: our dt / primal+dt / primalformer-dt against
HuggingFace ``transformers.DecisionTransformerModel`` at the same sizes, in the same run.

    python -m eval.bench.train                                   # paper and original-DT sizes
    python -m eval.bench.train --sizes paper --rounds 5 --json bench-train.json --markdown docs/results/training-step.md

A step is what training does: forward on K-step segments (batch 64, K = 20), masked action MSE (+ eta *
KSVD for primal layers), backward, grad-norm clip 0.25, AdamW, dropout 0.1, on synthetic batches with the
sampler's shapes and padding (timing does not depend on values), the same for every model. On a shared CPU
load drifts, so the models take turns, ``--steps`` timed steps each per round; a figure is the median over
all of a model's steps (and the fastest: load only ever adds time). ``transformers`` is the ``bench``
extra.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from agents.decision_transformer import Batch, DecisionTransformer, DTConfig
from agents.stream_training import first_exact_step, stream_exact_batch, stream_exact_config
from agents.train_step import Stepper
from primal_dt.run import errors, options

from . import timing

SIZES = {"paper": dict(d_model=256, n_heads=4, n_layers=3, s=64), "original": dict(d_model=128, n_heads=1, n_layers=3, s=64)}
OURS = ("dt", "primal+dt", "primalformer-dt")
STATE_DIM, ACT_DIM, ETA, CLIP = 11, 3, 0.05, 0.25


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
                 **stepper):
        cfg = DTConfig(state_dim=STATE_DIM, act_dim=ACT_DIM, K=K, name=layout, dropout=0.1, **size)
        self.first = None
        if window:  # stream-exact training (agents.stream_training): every layer windowed, the loss masked to exact steps
            cfg = stream_exact_config(cfg, window)
            self.first = first_exact_step(cfg)
        self.model = DecisionTransformer(cfg).to(device).train()
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, weight_decay=1e-4, fused=mode != "eager")
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0)
        self.stepper = Stepper(mode, self.model, self.params, self.opt, self.sched, ETA, CLIP, **stepper)

    def step(self, b: Batch) -> None:
        self.stepper.step(b if self.first is None else stream_exact_batch(b, self.first))


def hf_config(cfg: dict, K: int, dropout: float):
    """transformers' DecisionTransformerConfig at our size (``cfg``: state_dim, act_dim, d_model, n_heads,
    n_layers; ReLU MLP 4x as our blocks), or a SetupError saying how to install it."""
    try:
        from transformers import DecisionTransformerConfig
        from transformers.utils import logging
    except ImportError as err:
        raise errors.SetupError("the HuggingFace baseline needs `transformers` (a benchmark-only extra): pip install "
                                "'primal-dt[bench]' (keeps torch as it is), or leave HuggingFace out") from err
    logging.set_verbosity_error()
    d = cfg["d_model"]
    return DecisionTransformerConfig(state_dim=cfg["state_dim"], act_dim=cfg["act_dim"], hidden_size=d,
                                     n_layer=cfg["n_layers"], n_head=cfg["n_heads"], n_inner=4 * d,
                                     activation_function="relu", max_ep_len=1000, n_positions=3 * K,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, action_tanh=True)


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


def bench_size(name: str, size: dict, args, with_hf: bool) -> dict:
    # {suffix: (Ours options, ratio label)}: each form of our step against its layout's eager float32 one ("")
    forms = {"" if mode == "eager" else f"[{mode}]": (dict(mode=mode), "eager (time)") for mode in args.compile}
    if "bf16" in args.amp:
        forms["[bf16]"] = (dict(autocast=torch.bfloat16), "(time; bf16 autocast / float32)")
    if args.stream_window:
        forms[f"[w={args.stream_window}]"] = (dict(window=args.stream_window), "(time; stream-exact / standard)")
    hf = "hf:DecisionTransformerModel"
    torch.manual_seed(0)
    runners = {f"ours:{lay}{v}": Ours(lay, size, args.K, **kw) for v, (kw, _) in forms.items() for lay in OURS}
    if with_hf:
        runners[hf] = HuggingFace(size, args.K)
    data = batches(args.warmup + args.rounds * args.steps, args.batch, args.K)
    times, cpu = {k: [] for k in runners}, {k: [] for k in runners}  # wall and process seconds per step
    for r in runners.values():
        for b in data[: args.warmup]:
            r.step(b)
    for rnd in range(args.rounds):
        chunk = data[args.warmup + rnd * args.steps: args.warmup + (rnd + 1) * args.steps]
        for k, r in runners.items():
            for b in chunk:
                t0, c0 = time.perf_counter(), time.process_time()
                r.step(b)
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
        print(f"  [{name}] after round {rnd + 1}/{args.rounds}, median ms/step: "
              + ", ".join(f"{k} {1000 * statistics.median(v):.0f}" for k, v in times.items()), flush=True)
    tokens = args.batch * 3 * args.K
    res = {"size": name, **size, "K": args.K, "batch": args.batch, "models": {}}
    for k, v in times.items():
        med = statistics.median(v)
        res["models"][k] = {"ms_per_step": round(1000 * med, 2), "ms_per_step_min": round(1000 * min(v), 2),
                            "tokens_per_s": round(tokens / med), "cpu_ms_per_step": round(1000 * statistics.median(cpu[k]), 2),
                            "params": sum(p.numel() for p in runners[k].params), "timed_steps": len(v)}
    pairs = {f"{lay} / dt (time)": (f"ours:{lay}", "ours:dt") for lay in OURS[1:]}
    if with_hf:
        pairs |= {"hf / ours dt (time; > 1: ours faster)": (hf, "ours:dt"),
                  "hf / ours primal+dt (time)": (hf, "ours:primal+dt")}
    pairs |= {f"{lay}{v} / {lay} {label}": (f"ours:{lay}{v}", f"ours:{lay}")
              for v, (_, label) in forms.items() if v for lay in OURS}
    # the fastest step and the process's own CPU time: less of what another process's load on a shared CPU adds
    m = res["models"]
    for key, field in (("ratios", "ms_per_step"), ("ratios_of_min", "ms_per_step_min"),
                       ("ratios_of_cpu_time", "cpu_ms_per_step")):
        res[key] = {label: round(m[a][field] / m[b][field], 3) for label, (a, b) in pairs.items()}
    return res


@dataclass
class TrainBenchConfig(timing.Outputs):
    sizes: tuple[Literal["paper", "original"], ...] = tuple(SIZES)
    """model sizes to time: paper (width 256, 4 heads, 3 layers, the Primal-Attention paper's) | original (width
    128, 1 head, 3 layers, the original DT's)"""
    batch: int = 64
    """segments per step"""
    K: int = 20
    """context length in environment steps"""
    steps: int = 3
    """timed steps per model per round"""
    rounds: int = 4
    """rounds, each timing every model in turn"""
    warmup: int = 2
    """untimed steps per model first"""
    threads: int = 1
    """torch threads (0: torch's default)"""
    compile: tuple[Literal["eager", "compile"], ...] = ("eager",)
    """training-step forms to time (agents.train_step): eager (the reference) | compile (torch.compile; its
    compilation falls in the warm-up steps)"""
    amp: tuple[Literal["off", "bf16"], ...] = ("off",)
    """mixed precisions of the eager step to time: off (float32, the reference) | bf16 (``amp=bf16`` of
    ``primal_dt.train``: the forward and loss in bf16 autocast, which pays where bf16 matmuls are native)"""
    stream_window: int = 0
    """also time stream-exact training (``stream_window=W`` of ``primal_dt.train``: every layer windowed to W
    tokens, the loss on exact steps only) of each model beside its standard step (0: do not)"""
    no_hf: bool = False
    """skip transformers' model"""


PROG = "python -m eval.bench.train"
NUMBERS = {"batch": options.AT_LEAST_1, "K": options.AT_LEAST_1, "steps": options.AT_LEAST_1,
           "rounds": options.AT_LEAST_1, "warmup": options.AT_LEAST_0, "threads": options.THREADS,
           "stream_window": options.AT_LEAST_0}


def check(args: TrainBenchConfig) -> None:
    if "off" not in args.amp:
        raise ValueError("--amp must include off (the float32 step the ratios are against)")
    if "eager" not in args.compile:
        raise ValueError("--compile must include eager (the reference the ratios are against)")
    if not args.sizes:
        raise ValueError(f"--sizes names no size; give some of {', '.join(SIZES)}")
    if not args.no_hf:
        try:
            hf_config(dict(SIZES["original"], state_dim=1, act_dim=1), 1, 0.0)
        except errors.SetupError as err:
            raise ValueError(f"{err} (or pass --no-hf)") from None


def parse_args(argv: list[str] | None = None) -> tuple[TrainBenchConfig, list[str]]:
    return timing.parse(TrainBenchConfig, argv, PROG, __doc__, NUMBERS, check=check)


def main(argv: list[str] | None = None) -> dict:
    args, argv = parse_args(argv)
    with_hf = not args.no_hf
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    results = {"machine": timing.machine(PROG, argv), "results": []}
    if with_hf:
        import transformers

        results["transformers"] = transformers.__version__
    print(f"DT training-step benchmark (torch {torch.__version__}, {torch.get_num_threads()} thread(s)); "
          f"{args.rounds} rounds x {args.steps} steps per model", flush=True)
    rows, notes = [], []
    for s in args.sizes:
        r = bench_size(s, SIZES[s], args, with_hf)
        results["results"].append(r)
        rows += [[f"{s} ({r['d_model']}, {r['n_heads']} heads)", k, f"{v['ms_per_step']:.1f}", f"{v['ms_per_step_min']:.1f}",
                  f"{v['ms_per_step'] / r['models']['ours:dt']['ms_per_step']:.2f}", f"{v['params']:,}"]
                 for k, v in r["models"].items()]
        notes += [f"{s}: " + "; ".join(f"{k} {v:.3f}" for k, v in r[key].items()) + f" ({what})" for key, what in
                  (("ratios", "median step"), ("ratios_of_min", "fastest step, less sensitive to load"),
                   ("ratios_of_cpu_time", "the process's CPU time, which others' load does not add"))]
    timing.write(results, args.json, args.markdown, f"Training step: our DT models{' against HuggingFace' * with_hf} (batch "
                 f"{args.batch}, K = {args.K}; median of {args.rounds * args.steps} steps per model, models in turns)",
                 [timing.table(["size", "model", "ms per step", "fastest step", "x ours:dt", "parameters"], rows)], notes)
    return results


if __name__ == "__main__":
    main()
