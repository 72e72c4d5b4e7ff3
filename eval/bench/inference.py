"""Inference benchmark: streaming vs recompute Decision-Transformer agents, and the evaluator.

    python -m eval.bench.inference                                  # random hopper-sized primal+dt model
    python -m eval.bench.inference checkpoint=runs/.../last.pt json=bench.json
    python -m eval.bench.inference episodes=100 seq_episodes=20     # time 20 sequential episodes, scale to 100

Everything is measured in one run on one model (a checkpoint, or a random model of the papers' DT size:
width 256, 4 heads, 3 layers, primal+dt with s = 64), so the printed ratios compare like with like:

1. per-step action latency at batch 1 and batch 100, K = 20 and K = 100:
   - ``stream``: ``agent.act`` of the streaming agent (bookkeeping included), at episode step t = K
     and at t = 10, 100, 1000 (flat in t: its state does not grow);
   - ``recompute``: ``agent.act`` of the recompute agent with a full K-step context;
   - HuggingFace ``DecisionTransformerModel`` (same sizes, random weights: latency only), its
     documented usage: ``model(states, actions, rewards, returns_to_go, timesteps, attention_mask)``
     on the last K steps, then ``action_preds[:, -1]`` (model call only, no bookkeeping).
   For K = 100 the engines use a 100-step context (recompute) / a 299-token softmax cache (stream).
2. wall time to evaluate ``episodes`` Hopper episodes: our vectorised stream evaluator
   (``eval.rollout.evaluate``: one simulator per episode in two SyncVectorEnv lanes, each stepping in
   its own process while the other lane's agent acts, finished rows leaving the batch) vs a sequential
   one-episode-at-a-time recompute loop at batch 1 (the reference implementations' protocol),
   same seeds.

Timings on a shared CPU are noisy: each latency is the median over ``rounds`` rounds of ``calls``
calls, measured interleaved per setting, and every ratio is taken inside this run.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from primal_dt import runtime

RANDOM_MODEL_ENV = "hopper-medium"
"""the dataset whose dimensions, simulator and targets the random model (no checkpoint) takes"""


@dataclass
class BenchConfig:
    checkpoint: str = ""
    """kind="dt" checkpoint ('' : a random model of the DT papers' size)"""
    layout: str = "primal+dt"
    """layout of the random model"""
    batches: str = "1,100"
    contexts: str = "20,100"
    ts: str = "10,100,1000"
    """episode steps at which the stream latency is measured"""
    calls: int = 30
    rounds: int = 5
    latency: bool = True
    """run the latency section (false: only the evaluation wall-time comparison)"""
    episodes: int = 100
    """Hopper episodes for the evaluation wall-time comparison (0: skip)"""
    lane_layouts: bool = True
    """also time the evaluator with thread lanes and with one lane (what the process lanes buy)"""
    seq_episodes: int = 0
    """episodes actually run by the sequential loop (0: all); its time is scaled to ``episodes``"""
    max_steps: int = 1000
    hf: bool = True
    """include the HuggingFace baseline (needs `transformers`)"""
    threads: int = 1
    json: str = ""
    seed: int = 0


NUMBERS = {"calls": runtime.AT_LEAST_1, "rounds": runtime.AT_LEAST_1, "episodes": runtime.AT_LEAST_0,
           "seq_episodes": runtime.AT_LEAST_0, "max_steps": runtime.AT_LEAST_1, "threads": runtime.THREADS,
           "seed": runtime.SEED}


def int_list(bc: BenchConfig, key: str) -> list[int]:
    """A comma list option (``batches=1,100``) as integers >= 1, or a ValueError naming it."""
    text = getattr(bc, key)
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{key} must be a comma-separated list of integers, got {text!r}") from None
    runtime.check_number(key, values or None, runtime.AT_LEAST_1)
    if not values:
        raise ValueError(f"{key} must name at least one value, got {text!r}")
    return values


def check(bc: BenchConfig) -> None:
    """Every option, before a model is built or a simulator started."""
    runtime.check_numbers(bc, NUMBERS)
    for key in ("batches", "contexts", "ts"):
        int_list(bc, key)


def hf_model(cfg, K: int):
    try:
        from transformers import DecisionTransformerConfig, DecisionTransformerModel
        from transformers.utils import logging as hf_logging
    except ImportError as err:
        raise SystemExit("error: the HuggingFace baseline needs `transformers` (a benchmark-only extra): "
                         "pip install 'primal-dt[bench]' (keeps torch as it is), or run with hf=false") from err
    hf_logging.set_verbosity_error()
    c = DecisionTransformerConfig(state_dim=cfg.state_dim, act_dim=cfg.act_dim, hidden_size=cfg.d_model,
                                  n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=int(cfg.mlp_ratio * cfg.d_model),
                                  activation_function=cfg.activation, max_ep_len=cfg.max_timestep,
                                  n_positions=max(1024, 3 * K), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return DecisionTransformerModel(c).eval()


def build_model(bc: BenchConfig):
    """(model, DataInfo): the checkpoint's, or a random model of the DT papers' size for hopper-medium
    (dimensions, simulator and targets from ``envs``; identity statistics; the trainer's default
    reward scale, the papers' 1000)."""
    from agents import dt_checkpoint
    from agents.decision_transformer import DecisionTransformer, DTConfig
    from primal_dt.train_config import TrainConfig

    if bc.checkpoint:
        ck = dt_checkpoint.load(bc.checkpoint)
        return ck.build_model(), ck.data
    import envs

    spec = envs.get_spec(RANDOM_MODEL_ENV)
    torch.manual_seed(bc.seed)
    m = DecisionTransformer(DTConfig(spec.obs_dim, spec.act_dim, K=20, layout=bc.layout,
                                     options={"primal": {"s": 64}}, dropout=0.0)).eval()
    info = dt_checkpoint.DataInfo(env=spec.name, state_mean=np.zeros(spec.obs_dim), state_std=np.ones(spec.obs_dim),
                                  reward_scale=TrainConfig.reward_scale, targets=spec.targets, source="random model")
    return m, info


def with_context(model, K: int):
    """The same weights with context length K (K is not a parameter: it sets recompute's context and
    the stream's softmax cache)."""
    import copy
    import dataclasses

    m = copy.copy(model)  # shares the modules and parameters
    m.cfg = dataclasses.replace(model.cfg, K=K)
    return m


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def median_ms(fns: dict, calls: int, rounds: int, round_s: float = 0.5) -> dict:
    """Interleaved rounds: every round times each function once (up to ``calls`` calls, fewer for
    slow ones so a round takes about ``round_s``); the median round per function."""
    out = {k: [] for k in fns}
    n = {}
    for k, f in fns.items():
        f()  # warm-up
        t0 = time.perf_counter()
        f()
        one = time.perf_counter() - t0
        n[k] = max(1, min(calls, int(round_s / max(one, 1e-6))))
    for _ in range(rounds):
        for k, f in fns.items():
            out[k].append(timed(f, n[k]))
    return {k: statistics.median(v) for k, v in out.items()}


def make_agent(model, info, engine: str, context: int | None = None):
    """An agent with the run's bookkeeping (``info``: the checkpoint's DataInfo), aiming at its first target."""
    from agents.agent import Agent

    return Agent(model, state_mean=info.state_mean, state_std=info.state_std, reward_scale=info.reward_scale,
                 target=info.eval_targets[0], engine=engine, context=context)


def agent_at(model, info, engine, B, t, context=None):
    """An agent with B rows advanced to episode step t; returns (agent, a function doing one step)."""
    ag = make_agent(model, info, engine, context)
    ag.reset(B)
    g = np.random.default_rng(0)
    obs = g.normal(size=(B, model.cfg.state_dim)).astype(np.float32)
    rew = np.ones(B, np.float32)
    ag.act(obs)
    for _ in range(t - 1):
        ag.act(obs, rew)
    return ag, (lambda: ag.act(obs, rew))


def latency_section(model, info, bc: BenchConfig) -> dict:
    batches, contexts, ts = (int_list(bc, k) for k in ("batches", "contexts", "ts"))
    res = {}
    for K in contexts:
        mk = with_context(model, K)
        hf = hf_model(model.cfg, K) if bc.hf else None
        for B in batches:
            fns = {}
            _, fns["stream"] = agent_at(mk, info, "stream", B, K)
            _, fns["recompute"] = agent_at(mk, info, "recompute", B, K)
            if hf is not None:
                g = torch.Generator().manual_seed(0)
                c = model.cfg
                s, a = torch.randn(B, K, c.state_dim, generator=g), torch.rand(B, K, c.act_dim, generator=g)
                r, R = torch.zeros(B, K, 1), torch.randn(B, K, 1, generator=g)
                tt = torch.arange(K).expand(B, K).contiguous()
                am = torch.ones(B, K, dtype=torch.long)

                def hf_step(s=s, a=a, r=r, R=R, tt=tt, am=am):
                    with torch.inference_mode():
                        out = hf(states=s, actions=a, rewards=r, returns_to_go=R, timesteps=tt, attention_mask=am,
                                 return_dict=True)
                        return out.action_preds[:, -1].numpy()
                fns["hf_recompute"] = hf_step
            ms = median_ms(fns, bc.calls, bc.rounds)
            key = f"K{K}_B{B}"
            res[key] = {"K": K, "batch": B, **{f"{k}_ms": v for k, v in ms.items()}}
            line = f"K={K:4d} batch={B:4d}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
            if "hf_recompute" in ms:
                res[key]["hf_over_stream"] = ms["hf_recompute"] / ms["stream"]
                line += f"  | HF/stream {res[key]['hf_over_stream']:.1f}x"
            res[key]["recompute_over_stream"] = ms["recompute"] / ms["stream"]
            line += f", recompute/stream {res[key]['recompute_over_stream']:.1f}x"
            print(line, flush=True)
    # stream latency versus episode step t (model context 20)
    mk = with_context(model, contexts[0])
    for B in batches:
        fns = {f"t{t}": agent_at(mk, info, "stream", B, t)[1] for t in ts}
        ms = median_ms(fns, bc.calls, bc.rounds)
        res[f"stream_vs_t_B{B}"] = {"batch": B, **{f"{k}_ms": v for k, v in ms.items()},
                                     "max_over_min": max(ms.values()) / min(ms.values())}
        print(f"stream batch={B:4d} vs t: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
              + f"  (max/min {res[f'stream_vs_t_B{B}']['max_over_min']:.2f})", flush=True)
    return res


def sequential_recompute(model, info, spec, n: int, seed: int, max_steps: int, gym_id=None) -> tuple[float, list]:
    """The reference protocol: one episode at a time, batch-1 recompute agent."""
    from envs import make_env

    ag = make_agent(model, info, "recompute")
    env = make_env(spec.name, None, gym_id=gym_id)
    rets = []
    t0 = time.perf_counter()
    for e in range(n):
        obs, _ = env.reset(seed=seed + e)
        ag.reset(1)
        total, reward = 0.0, None
        for _ in range(max_steps):
            obs, r, term, trunc, _ = env.step(ag.act(obs[None], reward)[0])
            total += float(r)
            reward = np.array([r], np.float32)
            if term or trunc:
                break
        rets.append(total)
    env.close()
    return time.perf_counter() - t0, rets


def evaluation_section(model, info, bc: BenchConfig) -> dict:
    import envs
    from eval.rollout import evaluate

    spec = envs.get_spec(info.env)
    target = info.eval_targets[0]
    n_seq = bc.seq_episodes or bc.episodes
    # the evaluator as shipped (two lanes, each in its own process), then its simpler layouts
    layouts = {"lanes=2 process": dict(lanes=2, lane_workers="process")}
    if bc.lane_layouts:
        layouts.update({"lanes=2 thread": dict(lanes=2, lane_workers="thread"), "lanes=1": dict(lanes=1)})
    vec, details, res = {}, {}, None
    for name, kw in layouts.items():
        d = {}
        t0 = time.perf_counter()
        r = evaluate(model, spec, (target,), bc.episodes, bc.seed, state_mean=info.state_mean,
                     state_std=info.state_std, reward_scale=info.reward_scale, num_envs=bc.episodes,
                     max_steps=bc.max_steps, gym_id=info.gym_id, engine="stream", details=d, **kw)
        vec[name] = time.perf_counter() - t0
        if res is None:
            res, details = r, d
        print(f"  vectorised stream, {name}: {vec[name]:.1f} s", flush=True)
    vec_s = vec["lanes=2 process"]
    seq_s, seq_rets = sequential_recompute(model, info, spec, n_seq, bc.seed, bc.max_steps, info.gym_id)
    seq_scaled = seq_s * bc.episodes / n_seq
    out = {"episodes": bc.episodes, "vectorized_stream_s": vec_s, "vectorized_by_layout_s": vec,
           "sequential_recompute_s": seq_scaled, "sequential_episodes_run": n_seq, "speedup": seq_scaled / vec_s,
           "speedup_by_layout": {k: seq_scaled / v for k, v in vec.items()},
           "stream_mean_length": res[target]["length_mean"], "stream_return_mean": res[target]["return_mean"],
           "sequential_return_mean_over_run": float(np.mean(seq_rets)),
           "vectorized_agent_latency": details["latency"]}
    print(f"{bc.episodes} Hopper episodes (mean length {res[target]['length_mean']:.0f}): vectorised stream "
          f"{vec_s:.1f} s, sequential recompute {seq_scaled:.1f} s"
          + (f" (scaled from {n_seq} episodes)" if n_seq != bc.episodes else "")
          + f"  -> {out['speedup']:.1f}x"
          + "".join(f"; {k}: {v:.1f}x" for k, v in out["speedup_by_layout"].items() if k != "lanes=2 process"),
          flush=True)
    return out


def run(argv: list[str]) -> dict:
    from primal_dt.cli import parse

    bc = parse(BenchConfig, argv, prog="python -m eval.bench.inference",
               description="Streaming vs recompute DT inference latency, and evaluation wall time.")
    with runtime.setup_errors():
        check(bc)
        model, info = build_model(bc)
    runtime.set_threads(bc.threads)
    print(f"model: layers {model.layer_names}, d_model {model.cfg.d_model}, {model.cfg.n_heads} heads; "
          f"torch {torch.__version__}, {bc.threads} thread(s), {platform.processor() or platform.machine()}",
          flush=True)
    report = {"model_layers": model.layer_names, "d_model": model.cfg.d_model, "threads": bc.threads,
              "torch": torch.__version__, "config": vars(bc)}
    report["latency"] = latency_section(model, info, bc) if bc.latency else {}
    if bc.episodes > 0:
        report["evaluation"] = evaluation_section(model, info, bc)
    k = f"K{bc.contexts.split(',')[0]}_B1"
    if k in report["latency"] and "hf_over_stream" in report["latency"][k]:
        print(f"target: stream >= 10x lower per-step latency than HF recompute at K=20, batch 1: "
              f"{report['latency'][k]['hf_over_stream']:.1f}x")
    if "evaluation" in report:
        print(f"target: 100-episode evaluation >= 20x faster than the sequential loop: "
              f"{report['evaluation']['speedup']:.1f}x")
    if bc.json:
        with open(bc.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"report: {bc.json}")
    return report


def main(argv=None) -> dict:
    """``python -m eval.bench.inference``: bad options or checkpoints end with one ``error:`` line."""
    return runtime.main(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
