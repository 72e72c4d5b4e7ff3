"""Validation without a simulator: the masked action MSE on whole episodes the model never trains on.

A rollout is the score that matters, but slow, noisy and needs MuJoCo; the held-out action error is
cheap, deterministic and tells over-fitting from under-fitting. The segments are fixed once per run, so
the curve moves only when the model does.
"""

from __future__ import annotations

import numpy as np
import torch

import envs

from . import stream_training
from .decision_transformer import Batch
from .dt_checkpoint import DataInfo

MAX_SEGMENTS = 2048
"""held-out segments per validation at most: a forward pass over them costs a few training steps"""
CHUNK = 256
"""segments per forward pass"""
_SAMPLE_STREAM = 0x7661  # keys the fixed sample's generator apart from the split's and the sampler's


class Validation:
    """Every K-step segment starting in a held-out episode (or a seeded sample of ``MAX_SEGMENTS``), read
    with the training statistics. ``exact_from``: for stream-exact runs, the first segment step counted;
    ``from_start``: the prefix of every held-out episode, as such runs train."""

    def __init__(self, held_out: envs.Trajectories, info: DataInfo, K: int, max_timestep: int, seed: int,
                 device: torch.device, exact_from: int | None = None, from_start: bool = False):
        sampler = envs.SegmentSampler(held_out, K, 1, info.reward_scale, max_timestep, seed=None,
                                      stats=(info.state_mean, info.state_std))
        first = held_out.starts if from_start else np.arange(held_out.num_steps)
        if len(first) > MAX_SEGMENTS:
            rng = np.random.default_rng((int(seed), _SAMPLE_STREAM))
            first = np.sort(rng.choice(len(first), MAX_SEGMENTS, replace=False))
        batch = sampler.segments(first)
        if exact_from is not None:
            batch = stream_training.stream_exact_batch(batch, exact_from)
        self.batch = batch.to(device)
        self.episodes = len(held_out)
        self.segments = len(first)
        self.counted = int(batch.counted.sum()) * held_out.actions.shape[1]
        """action values the mean runs over"""

    def action_mse(self, model: torch.nn.Module) -> float:
        """One mean over every counted action value (not a mean of chunk means); no random stream moved."""
        was_training = model.training
        model.eval()
        sse = torch.zeros((), dtype=torch.float64, device=self.batch.mask.device)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                for i in range(0, self.segments, CHUNK):
                    b = Batch(*(None if v is None else v[i:i + CHUNK] for v in self.batch))
                    pred, _ = model(b)
                    m = b.counted.unsqueeze(-1).to(pred.dtype)
                    sse += ((pred - b.actions) ** 2 * m).sum(dtype=torch.float64)
        finally:
            model.train(was_training)
        return float(sse) / max(self.counted, 1)
