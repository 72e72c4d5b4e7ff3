"""Validation without a simulator: the masked action MSE of the model on episodes it never trains on.

A rollout in the simulator is the score that matters, but it is slow, noisy and needs MuJoCo; the
action error on held-out episodes is cheap, deterministic and tells over-fitting from under-fitting (d3rlpy
users ask for it, d3rlpy issue 406). The split is by whole episode (``envs.Trajectories.hold_out``,
drawn by the run's seed), the training episodes alone give the normalisation statistics, and the
held-out episodes are read with those statistics, as the model sees any new data.

The segments evaluated are fixed once per run: every K-step segment that starts at a step of a
held-out episode (the segments the sampler would draw from them, padding and masks included), or
when there are more than ``MAX_SEGMENTS``, a fixed sample of them drawn by the seed. So two calls on
the same weights give the same number, and the curve moves only when the model does.
"""

from __future__ import annotations

import numpy as np
import torch

import envs

from . import stream_training
from .decision_transformer import Batch
from .dt_checkpoint import DataInfo

MAX_SEGMENTS = 2048
"""at most this many held-out segments per validation (a 5 % split of a D4RL dataset holds tens of
thousands): a forward pass without gradients over them costs about what a few training steps cost, so
validating every ``eval.every`` steps is cheap beside training (the trainer times it as it runs)"""
CHUNK = 256
"""segments per forward pass"""
_SAMPLE_STREAM = 0x7661  # keys the fixed sample's generator apart from the split's and the sampler's


class Validation:
    """The fixed held-out segments of a run and their masked action MSE under a model.

    ``held_out``: the held-out episodes as their own ``Trajectories``; ``info``: the run's ``DataInfo``
    (training statistics, return-to-go scale); ``exact_from``: for stream-exact runs, the first segment step
    counted (``stream_training.first_exact_step``: the same loss mask as training), else None.
    """

    def __init__(self, held_out: envs.Trajectories, info: DataInfo, K: int, max_timestep: int, seed: int,
                 device: torch.device, exact_from: int | None = None):
        sampler = envs.SegmentSampler(held_out, K, 1, info.reward_scale, max_timestep, seed=None,
                                      stats=(info.state_mean, info.state_std))
        first = np.arange(held_out.num_steps)
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
        """Mean squared action error over every counted step and action dimension of the held-out
        segments (one mean over all of them, not a mean of chunk means); the model in eval mode (no
        dropout), no gradients, and no random stream moved."""
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
