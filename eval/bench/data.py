"""Data benchmark: cost of one K-step training batch versus the DT reference's sampler and
versus a DT training step, all measured in the same run.

    python -m eval.bench.data                         # hopper-medium-shaped synthetic data (1M steps)
    python -m eval.bench.data --dataset hopper-medium --json bench-data.json

Methods, per batch of B x K (default 64 x 20, the papers' setting):
- ``segment-sampler``: envs.SegmentSampler (uniform step draw + flat gathers, RTG precomputed).
- ``dt-reference``: a per-sample Python loop in the style of the Decision Transformer reference
  ``get_batch``: choose a trajectory (p proportional to length), slice it, compute the
  return-to-go with a Python ``discount_cumsum`` over the rest of the trajectory, pad with
  ``np.concatenate``, normalise, convert.
- ``loop-precomputed-rtg``: the same loop reading a precomputed RTG (isolates the loop cost).
- ``dt-train-step`` (context, not a sampler): forward+backward+AdamW of a DT-sized stand-in
  (torch TransformerEncoder, 3 layers, width 256, 4 heads, 3K tokens, batch B), so the
  sampler's cost can be read as a fraction of a training step.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from primal_dt.run import cli, options
from agents.train_config import TrainConfig


def synthetic(num_steps: int = 1_000_000, episodes: int = 2186, env: str = "hopper-medium", seed: int = 0):
    """Random data shaped like D4RL hopper-medium (1M steps, 2186 trajectories), with the
    observation and action sizes of ``env``'s simulator (from ``envs``)."""
    from envs import Trajectories, get_spec

    spec = get_spec(env)
    obs_dim, act_dim = spec.obs_dim, spec.act_dim
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.2, 1.8, episodes)
    lengths = np.maximum(1, (w / w.sum() * num_steps).astype(np.int64))
    n = int(lengths.sum())
    return Trajectories(observations=rng.standard_normal((n, obs_dim)), actions=rng.uniform(-1, 1, (n, act_dim)),
                        rewards=rng.uniform(0, 4, n), starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]),
                        lengths=lengths, terminal=np.ones(episodes, bool), source="synthetic")


def _discount_cumsum(x, gamma):
    out = np.zeros_like(x)
    out[-1] = x[-1]
    for t in reversed(range(x.shape[0] - 1)):
        out[t] = x[t] + gamma * out[t + 1]
    return out


class ReferenceLoop:
    """Per-sample sampler in the structure of the DT reference code (left as it is: a loop).
    ``reward_scale`` divides the returns-to-go, as in the reference and in envs.SegmentSampler."""

    def __init__(self, ds, K, batch_size, reward_scale, max_len=1000, precomputed_rtg=False, seed=0):
        self.trajs = [dict(observations=e["observations"], actions=e["actions"], rewards=e["rewards"],
                           dones=e["dones"], rtg=ds.rtg[s:s + n])
                      for e, s, n in zip(ds.episodes, ds.starts.tolist(), ds.lengths.tolist())]
        self.p = ds.lengths / ds.lengths.sum()
        self.K, self.B, self.scale, self.max_len = K, batch_size, reward_scale, max_len
        self.mean, self.std, self.pre = ds.state_mean, ds.state_std, precomputed_rtg
        self.rng = np.random.default_rng(seed)

    def sample(self):
        K = self.K
        ids = self.rng.choice(len(self.trajs), size=self.B, p=self.p)
        s, a, r, rtg, ts, mask = [], [], [], [], [], []
        for i in ids:
            tr = self.trajs[i]
            si = int(self.rng.integers(0, len(tr["rewards"])))
            obs = tr["observations"][si:si + K]
            n = len(obs)
            g = tr["rtg"][si:si + K] if self.pre else _discount_cumsum(tr["rewards"][si:], 1.0)[:n]
            t = np.minimum(np.arange(si, si + n), self.max_len - 1)
            s.append(np.concatenate([(obs - self.mean) / self.std, np.zeros((K - n, obs.shape[1]), np.float32)])[None])
            act = tr["actions"][si:si + K]
            a.append(np.concatenate([act, np.zeros((K - n, act.shape[1]), np.float32)])[None])
            r.append(np.concatenate([tr["rewards"][si:si + K], np.zeros(K - n, np.float32)])[None, :, None])
            rtg.append(np.concatenate([g / self.scale, np.zeros(K - n, np.float32)])[None, :, None])
            ts.append(np.concatenate([t, np.zeros(K - n, np.int64)])[None])
            mask.append(np.concatenate([np.ones(n, bool), np.zeros(K - n, bool)])[None])
        return {"states": torch.from_numpy(np.concatenate(s)).float(), "actions": torch.from_numpy(np.concatenate(a)),
                "rewards": torch.from_numpy(np.concatenate(r)), "rtg": torch.from_numpy(np.concatenate(rtg)).float(),
                "timesteps": torch.from_numpy(np.concatenate(ts)), "mask": torch.from_numpy(np.concatenate(mask))}


def _time(fn, repeat: int, min_time: float = 0.2) -> float:
    """Median seconds per call over ``repeat`` rounds of enough calls to last ``min_time``."""
    fn()
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < min_time:
        fn()
        calls += 1
    per_round = max(1, calls)
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(per_round):
            fn()
        out.append((time.perf_counter() - t) / per_round)
    return statistics.median(out)


def train_step_fn(batch: int, K: int, obs_dim: int, act_dim: int, width: int = 256):
    layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    emb = torch.nn.Linear(obs_dim, width)
    head = torch.nn.Linear(width, act_dim)
    params = [*enc.parameters(), *emb.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randn(batch, 3 * K, obs_dim)
    y = torch.randn(batch, 3 * K, act_dim)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(3 * K)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = ((head(enc(emb(x), mask=causal, is_causal=True)) - y) ** 2).mean()
        loss.backward()
        opt.step()

    return step


@dataclass
class DataBenchConfig:
    """Options of ``python -m eval.bench.data``."""

    dataset: str | None = None
    """a dataset name to load (none: synthetic data of hopper-medium's size)"""
    batch: int = 64
    """segments per batch"""
    K: int = 20
    """segment length in environment steps"""
    reward_scale: float = TrainConfig.reward_scale
    """returns-to-go are divided by this (the trainer's default, the DT papers' 1000)"""
    repeat: int = 7
    """timed repetitions per method"""
    threads: int = 1
    """torch CPU threads"""
    no_train_step: bool = False
    """skip the DT training-step context row"""
    json: str | None = None
    """also write the results here"""


def parse_args(argv=None) -> DataBenchConfig:
    """The options, every numeric one checked (``cli.fail`` otherwise)."""
    a = cli.parse(DataBenchConfig, argv, prog="python -m eval.bench.data", description=__doc__.split("\n\n")[0])
    options.check_parsed(a, {"--batch": options.AT_LEAST_1, "--K": options.AT_LEAST_1,
                             "--reward_scale": options.POSITIVE, "--repeat": options.AT_LEAST_1,
                             "--threads": options.THREADS})
    if a.json:
        try:
            options.check_output_file(a.json, "--json")
        except ValueError as err:
            cli.fail(str(err))
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    from envs import SegmentSampler, load_dataset

    t = time.perf_counter()
    try:
        ds = load_dataset(a.dataset, verbose=True) if a.dataset else synthetic()
    except (KeyError, ValueError, FileNotFoundError) as err:  # an unknown name, a broken or missing file
        cli.fail(f"--dataset {a.dataset}: {err.args[0] if isinstance(err, KeyError) else err}")
    load_s = time.perf_counter() - t
    print(f"data: {ds.source}, {len(ds)} trajectories, {ds.num_steps:,} steps (built in {load_s:.2f} s); "
          f"batch {a.batch} x K={a.K}, {a.threads} thread(s)")
    t = time.perf_counter()
    ours = SegmentSampler(ds, K=a.K, batch_size=a.batch, reward_scale=a.reward_scale, seed=0)
    setup_s = time.perf_counter() - t
    ref = ReferenceLoop(ds, a.K, a.batch, a.reward_scale)
    pre = ReferenceLoop(ds, a.K, a.batch, a.reward_scale, precomputed_rtg=True)
    rows = {
        "segment-sampler": _time(ours.sample, a.repeat),
        "loop-precomputed-rtg": _time(pre.sample, a.repeat),
        "dt-reference": _time(ref.sample, a.repeat, min_time=0.5),
    }
    if not a.no_train_step:
        rows["dt-train-step"] = _time(train_step_fn(a.batch, a.K, ds.observations.shape[1], ds.actions.shape[1]),
                                      max(3, a.repeat // 2), min_time=0.5)
    base = rows["segment-sampler"]
    print(f"{'method':<24}{'ms/batch':>12}{'x segment-sampler':>20}")
    for k, v in rows.items():
        print(f"{k:<24}{v * 1e3:>12.3f}{v / base:>20.1f}")
    summary = {
        "speedup_vs_dt_reference": rows["dt-reference"] / base,
        "speedup_vs_loop_precomputed_rtg": rows["loop-precomputed-rtg"] / base,
    }
    if "dt-train-step" in rows:
        summary["sampler_fraction_of_train_step"] = base / rows["dt-train-step"]
        summary["dt_reference_fraction_of_train_step"] = rows["dt-reference"] / rows["dt-train-step"]
    for k, v in summary.items():
        print(f"{k}: {v:.4g}")
    result = {"dataset": ds.source, "steps": ds.num_steps, "trajectories": len(ds), "batch": a.batch, "K": a.K,
              "threads": a.threads, "sampler_setup_s": setup_s, "seconds_per_batch": rows, **summary}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
