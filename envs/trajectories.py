"""Episodes of an offline dataset, stored once as flat arrays ready for segment sampling.

Every source ends here, so the checks that protect training (finite values, dimensions that match the
simulator, at least one real episode) live here once. The flat layout (all steps back to back, plus
per-step episode end, timestep and return-to-go) makes batch sampling a handful of numpy gathers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from envs.registry import get_spec
from envs.sources import DatasetError

MAX_REWARD = 1e6
"""largest reward of one step accepted: a MuJoCo task's are a few units, so a larger one is a corrupt file
(left in, it would overflow the float32 returns-to-go and look like a learning rate that is too high)"""
CORRUPT = "The file is corrupt or was written by a diverged policy; regenerate or re-download it."
_HOLD_OUT_STREAM = 0x6864  # keys the held-out split's generator apart from every other stream of a seed


@dataclass(eq=False, repr=False)
class Trajectories:
    """E episodes, N steps: observations [N, obs], actions [N, act], rewards [N] (float32); episode e is rows
    starts[e] : starts[e] + lengths[e]; ``terminal`` [E]: it ended in a termination (else the time limit)."""

    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    terminal: np.ndarray
    name: str | None = None
    gym_id: str | None = None
    source: str = "memory"
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        where = self.source
        self.observations = np.ascontiguousarray(self.observations, dtype=np.float32)
        self.actions = np.ascontiguousarray(self.actions, dtype=np.float32)
        self.rewards = np.ascontiguousarray(self.rewards, dtype=np.float32).reshape(-1)
        for key, dtype in (("starts", np.int64), ("lengths", np.int64), ("terminal", bool)):
            setattr(self, key, np.asarray(getattr(self, key), dtype=dtype).reshape(-1))
        n = len(self.rewards)
        if n == 0 or len(self.lengths) == 0:
            raise DatasetError(f"{where}: the dataset holds no complete episode (0 steps usable)")
        if self.observations.ndim != 2 or self.actions.ndim != 2:
            raise DatasetError(f"{where}: observations and actions must be 2-D [steps, dim], got "
                               f"{self.observations.shape} and {self.actions.shape}")
        if not (len(self.observations) == len(self.actions) == n):
            raise DatasetError(f"{where}: {len(self.observations)} observations, {len(self.actions)} actions and "
                               f"{n} rewards; every step needs one of each")
        if (self.lengths <= 0).any() or int(self.lengths.sum()) != n or not np.array_equal(
                self.starts, np.concatenate([[0], np.cumsum(self.lengths)[:-1]])):
            raise DatasetError(f"{where}: episode starts/lengths do not tile the {n} steps")
        if not (len(self.starts) == len(self.lengths) == len(self.terminal)):
            raise DatasetError(f"{where}: starts, lengths and terminal flags differ in count")
        for what in ("observations", "actions", "rewards"):
            bad = np.argwhere(~np.isfinite(getattr(self, what)))
            if len(bad):
                raise DatasetError(f"{where}: {what} holds {len(bad)} NaN/inf value(s), first at index "
                                   f"{tuple(bad[0])}. {CORRUPT}")
        big = np.abs(self.rewards) > MAX_REWARD
        if big.any():
            raise DatasetError(f"{where}: rewards holds {int(big.sum())} value(s) larger than {MAX_REWARD:g} in size "
                               f"(the largest {float(np.abs(self.rewards).max()):.3g}, first at step "
                               f"{int(np.argmax(big))}), far beyond any simulator's reward per step. {CORRUPT}")
        if self.name is not None and self.gym_id is not None:
            spec = get_spec(self.name)
            if self.gym_id not in spec.simulators:
                raise DatasetError(
                    f"{where}: records simulator {self.gym_id!r}, which primal-dt cannot run; {spec.name}'s data comes "
                    f"from {' or '.join(spec.simulators)}. The file's provenance is damaged or it was recorded "
                    "elsewhere; regenerate it (python -m envs.collect) or use another file")
            want = spec.minari_obs_dim if self.gym_id == spec.minari_gym_id else spec.obs_dim, spec.act_dim
            if (self.observations.shape[1], self.actions.shape[1]) != want:
                raise DatasetError(
                    f"{where}: observations have {self.observations.shape[1]} dims and actions "
                    f"{self.actions.shape[1]}, but {self.gym_id} (the simulator of {spec.name}) has {want[0]} and "
                    f"{want[1]}. The file belongs to another environment; check the dataset name.")
        ends = self.starts + self.lengths
        ep_of_step = np.repeat(np.arange(len(self.lengths)), self.lengths)
        self.step_end = ends[ep_of_step]  # [N] one past the last row of the step's episode
        self.timesteps = np.arange(n, dtype=np.int64) - self.starts[ep_of_step]
        # Undiscounted return-to-go: suffix sums within each episode, in float64 so that a 1M-step
        # dataset does not lose precision in the global cumulative sum.
        suffix = np.cumsum(self.rewards[::-1], dtype=np.float64)[::-1]
        after = np.append(suffix, 0.0)[ends]  # suffix sum from the row after each episode
        self.rtg = (suffix - after[ep_of_step]).astype(np.float32)
        # Statistics of these episodes only: a split's training part is a ``subset`` with its own,
        # so episodes held out for validation never leak into the normalisation.
        obs64 = self.observations.astype(np.float64)
        self.state_mean = obs64.mean(0).astype(np.float32)
        self.state_std = (obs64.std(0) + 1e-6).astype(np.float32)

    @cached_property
    def fingerprint(self) -> str:
        """``sha256:<hex>`` of exactly what a model trains on, whatever file it came from: a checkpoint records
        it, so a run resumed on data that changed under the same path is refused."""
        h = hashlib.sha256()
        for name in ("observations", "actions", "rewards", "lengths", "terminal"):
            a = np.ascontiguousarray(getattr(self, name))
            h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
            h.update(a.data)
        return f"sha256:{h.hexdigest()}"

    def hold_out(self, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(training episodes, held-out episodes): sorted, disjoint indices. ``round(fraction * E)`` episodes (at
        least one) drawn by a generator of their own keyed by ``seed``, so the split is the same on every
        process and at every resume; whole episodes, since a held-out step would be seen through its
        neighbours' overlapping segments."""
        n = len(self)
        if not 0 <= fraction < 1:
            raise DatasetError(f"{self.source}: a held-out fraction must be in [0, 1), got {fraction}")
        k = max(1, round(fraction * n)) if fraction > 0 else 0
        if k >= n:
            raise DatasetError(f"{self.source}: holding out {k} of its {n} episode(s) (fraction {fraction:g}) leaves "
                               "none to train on; hold out less, or use a dataset with more episodes")
        held = np.sort(np.random.default_rng((int(seed), _HOLD_OUT_STREAM)).permutation(n)[:k])
        return np.setdiff1d(np.arange(n), held), held

    def best_episodes(self, fraction: float) -> np.ndarray:
        """Sorted indices of the ``fraction`` of episodes with the highest returns: filtered behaviour cloning's
        data (the Decision Transformer paper's %BC, CORL's any_percent_bc). ``floor(fraction * E)`` episodes, at
        least one, as CORL keeps; ties go to the earlier episode, so the choice is the same on every machine."""
        if not 0 < fraction <= 1:
            raise DatasetError(f"{self.source}: the fraction of best episodes must be in (0, 1], got {fraction}")
        n = len(self)
        k = max(1, int(fraction * n + 1e-9))  # 0.3 * 10 is 3, not 2.9999...
        return np.sort(np.argsort(-self.returns, kind="stable")[:k])

    def subset(self, episodes) -> "Trajectories":
        """These episodes as a dataset of their own, with their own statistics (that never saw held-out ones)."""
        idx = np.asarray(episodes, dtype=np.int64).reshape(-1)
        if idx.size == 0 or idx.min() < 0 or idx.max() >= len(self):
            raise IndexError(f"{self.source}: episode indices must be in [0, {len(self)}) and not empty")
        eps = self.episodes
        return Trajectories.from_episodes([eps[i] for i in idx.tolist()], name=self.name, gym_id=self.gym_id,
                                          source=self.source, metadata=dict(self.metadata))

    def clip_actions(self, low: float, high: float) -> int:
        """Clip actions into [low, high] in place; returns how many values moved."""
        outside = int(((self.actions < low) | (self.actions > high)).sum())
        if outside:
            np.clip(self.actions, low, high, out=self.actions)
            self.__dict__.pop("fingerprint", None)  # computed again from the clipped actions
        return outside

    @property
    def num_steps(self) -> int:
        return int(len(self.rewards))

    def __len__(self) -> int:
        return int(len(self.lengths))

    @property
    def returns(self) -> np.ndarray:
        """Undiscounted return of each episode, float64 [E]."""
        return self.rtg[self.starts].astype(np.float64)

    @property
    def episodes(self) -> list[dict]:
        """One dict per episode: observations, actions, rewards (views into the flat arrays), terminal, and
        dones (True only at the last step of a terminated episode)."""
        return [{"observations": self.observations[s:s + n], "actions": self.actions[s:s + n],
                 "rewards": self.rewards[s:s + n], "terminal": term, "dones": np.arange(n) == (n - 1 if term else -1)}
                for s, n, term in zip(self.starts.tolist(), self.lengths.tolist(), self.terminal.tolist())]

    def __repr__(self) -> str:
        return f"Trajectories({self.name or 'unnamed'}, {self.source}: {len(self)} episodes, {self.num_steps} steps)"

    def summary(self) -> str:
        r = self.returns
        return (f"{len(self)} episodes, {self.num_steps:,} steps, return {r.mean():.1f} +- "
                f"{r.std():.1f} (min {r.min():.1f}, max {r.max():.1f}), simulator {self.gym_id}")

    @classmethod
    def from_episodes(cls, episodes: list[dict], **kw) -> "Trajectories":
        """From dicts with observations [T, obs], actions [T, act], rewards [T] and a ``terminal`` flag."""
        if not episodes:
            raise DatasetError(f"{kw.get('source', 'memory')}: the dataset holds no episode")
        lengths = np.array([len(ep["rewards"]) for ep in episodes], dtype=np.int64)
        try:  # (a file's episodes may hold text, or arrays of another width than the others)
            arrays = {"observations": np.concatenate([np.asarray(ep["observations"], np.float32) for ep in episodes]),
                      "actions": np.concatenate([np.asarray(ep["actions"], np.float32) for ep in episodes]),
                      "rewards": np.concatenate([np.asarray(ep["rewards"], np.float32).reshape(-1) for ep in episodes])}
        except (TypeError, ValueError) as err:
            raise DatasetError(f"{kw.get('source', 'memory')}: its episodes' observations, actions and rewards are not "
                               f"numbers of one width in every episode ({err}). The files are corrupt; regenerate or "
                               "re-download them") from None
        return cls(**arrays, starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths=lengths,
                   terminal=np.array([bool(ep["terminal"]) for ep in episodes]), **kw)

    @classmethod
    def concat(cls, parts: list["Trajectories"], **kw) -> "Trajectories":
        """Episodes of several datasets back to back (medium-expert = medium + expert); one is itself."""
        return parts[0] if len(parts) == 1 else cls.from_episodes([ep for p in parts for ep in p.episodes], **kw)


def split_on_ends(terminals: np.ndarray, timeouts: np.ndarray, where: str, limit: int | None = None,
                  task: str = "the task"):
    """(starts, lengths, terminal flag per episode, steps kept), by D4RL's convention: an episode ends with a
    step flagged terminal or timeout; the unfinished fragment after the last end is dropped. One longer than
    ``limit`` (``task``'s step limit) means lost flags, so it is refused."""
    terminals = np.asarray(terminals).reshape(-1).astype(bool)
    timeouts = np.asarray(timeouts).reshape(-1).astype(bool)
    n = len(terminals)
    if n > 1 and terminals.all():
        raise DatasetError(f"{where}: every one of the {n} steps is marked terminal, which would make each step an "
                           "episode of length 1; the terminals array is corrupt (or was written as ones)")
    ends = np.flatnonzero(terminals | timeouts) + 1
    if len(ends) == 0:
        raise DatasetError(f"{where}: none of the {n} steps ends an episode (no terminal or timeout flag), so there "
                           "is no complete episode; the file is truncated or its flags are missing")
    starts = np.concatenate([[0], ends[:-1]])
    lengths = ends - starts
    if limit is not None:
        spans = np.append(lengths, n - ends[-1])  # the last: the fragment after the last end
        if spans.max() > limit:
            i = int(np.flatnonzero(spans > limit)[0])
            what = f"episode {i} (steps {starts[i]} to {ends[i] - 1})" if i < len(lengths) else \
                "the unfinished fragment after the last episode end"
            raise DatasetError(
                f"{where}: {what} is {spans[i]} steps long, more than {task}'s limit of {limit} steps per episode, "
                f"so its end flags cannot be right ({int(terminals.sum())} terminals and {int(timeouts.sum())} "
                f"timeouts in {n} steps). Check the file's terminals and timeouts arrays: terminals all zero "
                "mean they were lost when the file was converted")
    return starts, lengths, terminals[ends - 1], int(ends[-1])
