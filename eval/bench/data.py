"""Data benchmark: one K-step training batch (64 x 20, the papers') of ``envs.SegmentSampler`` against the
DT reference's sampler and a DT training step, in the same run.

    python -m eval.bench.data                         # hopper-medium-shaped synthetic data (1M steps)
    python -m eval.bench.data --dataset hopper-medium --json bench-data.json --markdown data.md

``dt-reference`` is the reference's ``get_batch``, a per-sample Python loop (return-to-go by a Python
``discount_cumsum``), ``loop-precomputed-rtg`` the same loop reading a precomputed one (the loop's own
cost), ``dt-train-step`` a DT-sized stand-in's forward+backward+AdamW, so the sampler reads as its fraction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from agents.train_config import TrainConfig
from primal_dt.run import cli, options

from . import timing


def synthetic(num_steps: int = 1_000_000, episodes: int = 2186, seed: int = 0):
    """Random data of D4RL hopper-medium's size and shapes (1M steps, 2186 trajectories)."""
    from envs import Trajectories, get_spec

    spec = get_spec("hopper-medium")
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.2, 1.8, episodes)
    lengths = np.maximum(1, (w / w.sum() * num_steps).astype(np.int64))
    n = int(lengths.sum())
    return Trajectories(observations=rng.standard_normal((n, spec.obs_dim)), actions=rng.uniform(-1, 1, (n, spec.act_dim)),
                        rewards=rng.uniform(0, 4, n), starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]),
                        lengths=lengths, terminal=np.ones(episodes, bool), source="synthetic")


def _discount_cumsum(x, gamma):
    out = np.zeros_like(x)
    out[-1] = x[-1]
    for t in reversed(range(x.shape[0] - 1)):
        out[t] = x[t] + gamma * out[t + 1]
    return out


class ReferenceLoop:
    """Per-sample sampler in the structure of the DT reference code (left as it is: a loop)."""

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
    dataset: str | None = None
    """a dataset name to load (none: synthetic data of hopper-medium's size)"""
    batch: int = 64
    """segments per batch"""
    K: int = 20
    """segment length in environment steps"""
    reward_scale: float = TrainConfig.reward_scale
    """returns-to-go are divided by this (the trainer's default, the DT papers' 1000)"""
    repeat: int = 7
    """timed rounds (methods interleaved; a figure is the median round)"""
    threads: int = 1
    """torch CPU threads"""
    no_train_step: bool = False
    """skip the DT training-step context row"""
    json: str | None = None
    """also write the results here"""
    markdown: str | None = None
    """also write the table here as Markdown, headed by the machine and the command"""


PROG = "python -m eval.bench.data"
NUMBERS = {"batch": options.AT_LEAST_1, "K": options.AT_LEAST_1, "reward_scale": options.POSITIVE,
           "repeat": options.AT_LEAST_1, "threads": options.THREADS}


def parse_args(argv=None) -> tuple[DataBenchConfig, list[str]]:
    return timing.parse(DataBenchConfig, argv, PROG, __doc__, NUMBERS)


def main(argv=None) -> dict:
    a, argv = parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    from envs import SegmentSampler, load_dataset

    t = time.perf_counter()
    try:
        ds = load_dataset(a.dataset, verbose=True) if a.dataset else synthetic()
    except (KeyError, ValueError, FileNotFoundError) as err:  # an unknown name, a broken or missing file
        cli.fail(f"--dataset {a.dataset}: {err.args[0] if isinstance(err, KeyError) else err}")
    print(f"data: {ds.source}, {len(ds)} trajectories, {ds.num_steps:,} steps (built in {time.perf_counter() - t:.2f} "
          f"s); batch {a.batch} x K={a.K}, {a.threads} thread(s)")
    t = time.perf_counter()
    ours = SegmentSampler(ds, K=a.K, batch_size=a.batch, reward_scale=a.reward_scale, seed=0)
    setup_s = time.perf_counter() - t
    fns = {"segment-sampler": ours.sample,
           "loop-precomputed-rtg": ReferenceLoop(ds, a.K, a.batch, a.reward_scale, precomputed_rtg=True).sample,
           "dt-reference": ReferenceLoop(ds, a.K, a.batch, a.reward_scale).sample}
    if not a.no_train_step:
        fns["dt-train-step"] = train_step_fn(a.batch, a.K, ds.observations.shape[1], ds.actions.shape[1])
    rows = {k: ms / 1e3 for k, ms in timing.median_ms(fns, calls=10**6, rounds=a.repeat).items()}
    base = rows["segment-sampler"]
    summary = {"speedup_vs_dt_reference": rows["dt-reference"] / base,
               "speedup_vs_loop_precomputed_rtg": rows["loop-precomputed-rtg"] / base}
    if "dt-train-step" in rows:
        summary["sampler_fraction_of_train_step"] = base / rows["dt-train-step"]
        summary["dt_reference_fraction_of_train_step"] = rows["dt-reference"] / rows["dt-train-step"]
    result = {"machine": timing.machine(PROG, argv), "dataset": ds.source, "steps": ds.num_steps,
              "trajectories": len(ds), "batch": a.batch, "K": a.K, "threads": a.threads, "sampler_setup_s": setup_s,
              "seconds_per_batch": rows, **summary}
    timing.write(result, a.json, a.markdown, f"One {a.batch} x {a.K} training batch ({ds.source} data)",
                 [timing.table(["method", "ms per batch", "x segment-sampler"],
                               [[k, f"{v * 1e3:.3f}", f"{v / base:.1f}"] for k, v in rows.items()])],
                 [f"{k}: {v:.4g}" for k, v in summary.items()])
    return result


if __name__ == "__main__":
    main()
