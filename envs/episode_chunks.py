"""Whole episodes in consecutive K-step chunks: the batches of training that carries a recurrent state.

A segment sampler (``SegmentSampler``) shows the model K steps cut anywhere; the stream engine shows it the
whole episode so far. ``EpisodeChunks`` keeps ``batch_size`` lanes, each walking one episode from its first
step in consecutive K-step chunks (the last one right-padded), then the next episode, drawn uniformly. The
trainer carries each lane's recurrent state from one chunk to the next (``agents.stream_training.Carry``), so
every prediction sees its whole episode so far, as the stream does, at the cost of a K-step segment.

A lane spends time on an episode in proportion to its length, so over training every dataset step is
visited equally often: the reference's sampling (a trajectory with probability proportional to its length,
a start uniform inside it) in the long run, without its overlapping segments.
"""

from __future__ import annotations

import numpy as np

from envs.sampler import SegmentSampler


class EpisodeChunks:
    """Lanes of consecutive chunks over ``segments``' tables and episodes (its ``top_fraction`` filter and
    generator included). ``indices()`` -> (rows [B, K], mask [B, K], fresh [B] bool: the lane's chunk starts
    its episode, so its carried state must restart)."""

    def __init__(self, segments: SegmentSampler, starts: np.ndarray, ends: np.ndarray):
        self.segments, self.K, self.batch_size = segments, segments.K, segments.batch_size
        self._starts, self._ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        """each drawable episode's first dataset step and the step after its last"""
        self.episode = np.full(self.batch_size, -1, np.int64)
        """each lane's episode (an index into the drawable ones; -1: none yet)"""
        self.next = np.zeros(self.batch_size, np.int64)
        """each lane's next chunk's first dataset step"""

    @classmethod
    def of(cls, segments: SegmentSampler, starts: np.ndarray, lengths: np.ndarray) -> "EpisodeChunks":
        """Lanes over the episodes ``segments`` draws from, given every episode's first step and length."""
        kept = segments.episodes
        return cls(segments, starts[kept], starts[kept] + lengths[kept])

    def indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        done = (self.episode < 0) | (self.next >= np.take(self._ends, np.maximum(self.episode, 0)))
        if done.any():
            self.episode[done] = self.segments.rng.integers(0, len(self._starts), size=int(done.sum()))
            self.next[done] = self._starts[self.episode[done]]
        idx, mask = self.segments.indices(first=self.next)
        self.next += self.K
        return idx, mask, done

    def batch(self, idx: np.ndarray):
        return self.segments.batch(idx)

    def state_dict(self) -> dict:
        """The generator and every lane's place, so a resumed run walks on as an uninterrupted one."""
        return {**self.segments.state_dict(), "lanes": {"episode": self.episode.tolist(), "next": self.next.tolist()}}

    def load_state_dict(self, state: dict) -> None:
        self.segments.load_state_dict(state)
        lanes = state.get("lanes")
        if not isinstance(lanes, dict) or any(len(lanes.get(k) or ()) != self.batch_size for k in ("episode", "next")):
            raise ValueError(f"the checkpoint's sampler has no lanes for {self.batch_size} episode chunks: it was not "
                             "written by a run with whole_episodes=true and this batch_size")
        episode, nxt = (np.asarray(lanes[k], np.int64) for k in ("episode", "next"))
        if ((episode < -1) | (episode >= len(self._starts))).any() or (nxt < 0).any():
            raise ValueError("the checkpoint's episode lanes point outside this dataset's episodes: resume with the "
                             "data the run trained on")
        self.episode, self.next = episode, nxt
