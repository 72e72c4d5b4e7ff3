"""K-step segments for sequence models, sampled as the Decision Transformer reference does.

The reference picks a trajectory with probability proportional to its length, then a start uniformly
inside it: the same as picking one of the N dataset steps uniformly, which is one ``integers`` draw and
gathers over the flat arrays of ``Trajectories``, no Python loop. A segment running past its episode's
end is right-padded (real tokens first) and masked. Step t of an episode is then counted from min(t + 1, K)
of its starts: the first steps of an episode are counted less often than the rest.

``lead`` (stream-exact training, ``agents.stream_training``) keeps those counts while giving every counted
step more context: a segment starts ``lead`` steps before its drawn step (or at its episode's first step,
if that is later) and counts the K - lead steps from the drawn one, so its counted steps are those of a
(K - lead)-step segment drawn at the same step, each seeing ``lead`` steps further back.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from envs.trajectories import Trajectories


class Batch(NamedTuple):
    """K-step segments with named fields (``SegmentSampler``'s batches; what a sequence model reads).
    Padding steps (after the real ones) are zero everywhere."""

    states: torch.Tensor
    """[B, K, obs_dim] float32, normalised by the dataset's (or the given) mean / std"""
    actions: torch.Tensor
    """[B, K, act_dim] float32"""
    rtg: torch.Tensor
    """[B, K, 1] float32: the return-to-go of the whole remaining episode / reward_scale"""
    timesteps: torch.Tensor
    """[B, K] int64, clipped to max_timestep - 1"""
    mask: torch.Tensor | None = None
    """[B, K] bool, True for real steps (None: all real)"""
    loss_mask: torch.Tensor | None = None
    """[B, K] bool: the steps a loss counts (None: ``mask``); stream-exact training narrows it"""
    rewards: torch.Tensor | None = None
    """[B, K, 1] float32, raw"""
    trailing: bool | None = None
    """whether every row's padding trails its real steps (the sampler's always does; None: unknown)"""
    state: tuple | None = None
    """the model's recurrent state at the segments' first steps (None: they start from nothing, as segments do):
    episode chunks carry their episode's (``envs.episode_chunks``)"""

    @property
    def counted(self) -> torch.Tensor | None:
        """The steps a loss counts: ``loss_mask``, else ``mask``."""
        return self.mask if self.loss_mask is None else self.loss_mask

    def to(self, device) -> "Batch":
        moved = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v
        return Batch(*(tuple(map(moved, v)) if isinstance(v, tuple) else moved(v) for v in self))


class SegmentSampler:
    """Batches of K-step segments (``Batch``) as torch tensors, or with ``from_start`` episode prefixes: K
    steps from an episode's first, so that each step's context is everything its episode showed before it.
    The return-to-go is undiscounted and divided by ``reward_scale`` (a divisor everywhere in the package:
    the DT papers' 1000; 1 leaves returns raw).
    ``stats`` = (state_mean, state_std) normalises with other statistics than the dataset's own: held-out
    episodes are read with the training episodes', as the model sees them.
    ``top_fraction`` < 1 draws segments only from that fraction of the episodes with the highest returns
    (``Trajectories.best_episodes``: filtered behaviour cloning); the tables and the normalisation stay the
    whole dataset's, so a filtered run scales its states as an unfiltered one on the same episodes does.
    The tables live on ``device`` and batches are gathered there: a batch costs one copy of its row indices
    (drawn on the host, so every device draws the same batches), not one per field, and no read-back."""

    def __init__(self, ds: Trajectories, K: int = 20, batch_size: int = 64, reward_scale: float = 1.0,
                 max_timestep: int = 1000, seed: int | np.random.Generator | None = 0,
                 device: str | torch.device = "cpu", stats: tuple[np.ndarray, np.ndarray] | None = None,
                 from_start: bool = False, top_fraction: float = 1.0, lead: int = 0):
        if K < 1 or batch_size < 1:
            raise ValueError(f"K and batch_size must be >= 1, got K={K}, batch_size={batch_size}")
        if not reward_scale > 0:
            raise ValueError(f"reward_scale must be > 0 (returns-to-go are divided by it), got {reward_scale}")
        if isinstance(lead, bool) or not isinstance(lead, (int, np.integer)) or not 0 <= lead < K:
            raise ValueError(f"lead must be an integer from 0 to K - 1 = {K - 1} (steps of context a segment starts "
                             f"before its drawn step), got {lead!r}")
        if not 0 < top_fraction <= 1:
            raise ValueError(f"top_fraction must be in (0, 1] (the share of episodes, by return, segments are drawn "
                             f"from), got {top_fraction}")
        self.K, self.batch_size, self.reward_scale = int(K), int(batch_size), float(reward_scale)
        self.max_timestep, self.device = int(max_timestep), torch.device(device)
        self.rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        self.num_steps = ds.num_steps
        mean, std = (ds.state_mean, ds.state_std) if stats is None else (np.asarray(s, np.float32) for s in stats)

        def table(rows: np.ndarray) -> torch.Tensor:
            """``rows`` and one zero row after them, on the device: padded positions gather index n and read
            zeros, so no mask is applied after the gather."""
            rows = rows.reshape(len(rows), -1)
            return torch.from_numpy(np.concatenate([rows, np.zeros((1, rows.shape[1]), rows.dtype)])).to(self.device)

        self._states = table((ds.observations - mean) / std)
        self._actions = table(ds.actions)
        self._rewards = table(ds.rewards)
        self._rtg = table(ds.rtg / np.float32(self.reward_scale))
        self._timesteps = table(np.minimum(ds.timesteps, self.max_timestep - 1).astype(np.int64))
        self._end = ds.step_end
        self.episodes = ds.best_episodes(top_fraction) if top_fraction < 1 else np.arange(len(ds))
        """the episodes segments are drawn from"""
        kept = np.zeros(len(ds), bool)
        kept[self.episodes] = True
        # first steps to draw from (None: every step, one ``integers`` draw as the reference's)
        self._first = None if kept.all() else np.flatnonzero(np.repeat(kept, ds.lengths))
        self._starts = ds.starts[self.episodes] if from_start else None
        self._offsets = np.arange(self.K, dtype=np.int64)
        self.lead = int(lead)
        """steps of context before each drawn step (module docstring; 0: segments start at their drawn steps)"""
        self._episode_start = np.arange(ds.num_steps, dtype=np.int64) - ds.timesteps  # [N] first row of the step's episode

    def indices(self, batch_size: int | None = None, first: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Row indices [B,K] into the padded tables (n = padding) and the mask [B,K] of the steps a loss counts
        (the real ones; with ``lead``, the K - lead from each drawn step), on the host, of segments drawn at
        random steps (``from_start``: at the first step of episodes drawn uniformly), or at the dataset steps
        ``first`` [B]."""
        if first is None and self._starts is not None:
            first = self._starts[self.rng.integers(0, len(self._starts), size=batch_size or self.batch_size)]
        elif first is None and self._first is not None:
            first = self._first[self.rng.integers(0, len(self._first), size=batch_size or self.batch_size)]
        elif first is None:
            first = self.rng.integers(0, self.num_steps, size=batch_size or self.batch_size)
        first = np.asarray(first, dtype=np.int64)
        start = np.maximum(first - self.lead, self._episode_start[first]) if self.lead else first
        idx = start[:, None] + self._offsets[None, :]
        mask = idx < np.take(self._end, start)[:, None]
        idx[~mask] = self.num_steps
        if self.lead:  # count the K - lead steps from the drawn one: the context before it is not counted
            drawn = (first - start)[:, None]
            mask &= (self._offsets >= drawn) & (self._offsets < drawn + self.K - self.lead)
        return idx, mask

    def sample(self, batch_size: int | None = None) -> Batch:
        return self.batch(*self.indices(batch_size))

    def segments(self, first: np.ndarray) -> Batch:
        """The batch of segments drawn at the given dataset steps (a fixed evaluation set)."""
        return self.batch(*self.indices(first=first))

    def batch(self, idx: np.ndarray, counted: np.ndarray | None = None) -> Batch:
        """The segments at row indices ``idx`` [B,K] (``indices``), gathered on the device; with ``lead``, the
        steps ``counted`` (``indices``' mask) are the batch's ``loss_mask``."""
        b, k = idx.shape
        i = torch.from_numpy(idx)
        if self.device.type == "cuda":  # pinned, so the copy runs behind the host: the loop never waits on the GPU
            i = i.pin_memory()
        i = i.to(self.device, non_blocking=True)
        flat = i.reshape(-1)
        rows = lambda t: t.index_select(0, flat).reshape(b, k, -1)
        loss_mask = None
        if self.lead and counted is not None:
            loss_mask = torch.from_numpy(np.asarray(counted, bool)).to(self.device, non_blocking=True)
        return Batch(states=rows(self._states), actions=rows(self._actions), rewards=rows(self._rewards),
                     rtg=rows(self._rtg), timesteps=rows(self._timesteps).reshape(b, k), mask=i < self.num_steps,
                     loss_mask=loss_mask, trailing=True)

    def state_dict(self) -> dict:
        """RNG state, so a resumed training run draws the same batches as an uninterrupted one."""
        return {"bit_generator": self.rng.bit_generator.state, "K": self.K, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["bit_generator"]
