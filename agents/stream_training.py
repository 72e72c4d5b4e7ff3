"""Stream-exact training (``stream_window``): train on exactly what the stream engine shows the model.

The stream engine computes ``model.forward`` over the whole episode so far; training sees K-step
segments. The two agree when (1) every layer is windowed (``window=W_l`` tokens), so a token's output
depends on a *reach* of R = sum_l (W_l - 1) earlier tokens, and (2) the loss counts only steps whose
reach lies in their segment: the predicting token of step i (token n i + p, ``TokenLayout``) has
n i + p >= R, or the segment starts its episode. Then every counted prediction is the stream's, and the
trained objective is the deployed policy; K > ``first_exact_step`` for any step to count.

The other way to an exact stream (``from_start``): train on episode prefixes, segments of K >= max_timestep
steps from an episode's first, so every prediction sees its whole episode so far, which is what the stream
engine computes (unwindowed primal running means from the episode's start; a softmax ring of 3K - 1 tokens
holds the whole episode). No window, no step left out of the loss; each segment costs K steps of compute.

The third (``whole_episodes``): train on whole episodes K steps at a time (``envs.episode_chunks``), each chunk
run through the stream's own recurrent form from the state its episode's previous chunk left (``Carry``). Every
prediction then sees its whole episode so far exactly as the stream engine computes it (primal running means
over the episode, a softmax ring of 3K - 1 tokens), and a step costs a K-step segment's. The carried state was
computed by the weights of the steps before (no gradient flows back through it: truncated backpropagation
through time), so within a step it lags the current weights by the chunks since its episode began; for the
fixed weights a checkpoint holds, the stream and the chunked forward agree (tests/agents/test_whole_episodes.py).

Which policy an engine measures, recorded by every evaluation output: ``Fidelity``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from envs.episode_chunks import EpisodeChunks
from primal_dt.attention import available, get_class
from primal_dt.attention.base import restart_rows
from primal_dt.run.options import attention_words

from .decision_transformer import Batch, DTConfig


def windowed() -> list[str]:
    return [n for n in available() if get_class(n).supports_window]


def stream_exact_config(cfg: DTConfig, window: int) -> DTConfig:
    """``cfg`` with every attention layer windowed to ``window`` tokens (error if a layer cannot be)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1 (tokens), got {window!r}")
    options = cfg.options()
    for name in windowed():
        options.setdefault(name, {})["window"] = window
    new = dataclasses.replace(cfg, attention_options=attention_words(options))
    receptive_field(new)  # checks every layer
    return new


def layer_windows(cfg_or_model) -> list[int]:
    """Window (tokens) of every layer; a clear error for layers without one."""
    cfg = getattr(cfg_or_model, "cfg", cfg_or_model)
    out = []
    for i, spec in enumerate(cfg.layer_specs()):
        w = spec.options.get("window")
        if not get_class(spec.attention).supports_window or w is None:
            raise ValueError(f"stream-exact training needs every layer windowed; layer {i} ({spec.attention}) has no "
                             f"window. Use layers that take one ({', '.join(windowed())}) with options "
                             f"{{'softmax': {{'window': W}}, 'primal': {{'window': W}}}} (stream_exact_config)")
        out.append(int(w))
    return out


def receptive_field(cfg_or_model) -> int:
    """R = sum over layers of (window - 1): how many earlier tokens a state token's output depends on."""
    return sum(w - 1 for w in layer_windows(cfg_or_model))


def first_exact_step(cfg_or_model) -> int:
    """Smallest segment step index whose predicting token has its whole reach in the segment."""
    return cfg_or_model.tokens.first_exact_step(receptive_field(cfg_or_model))


def counting_line(cfg, model) -> str:
    """What a stream_window run's loss counts, as it starts ('' for other runs): the window, its reach, and which
    steps of a segment are counted (``TrainConfig.stream_counts``)."""
    if not cfg.stream_window:
        return ""
    reach, first = receptive_field(model), first_exact_step(model)
    line = (f"stream-exact: every layer windowed to {cfg.stream_window} tokens, so a step's prediction reaches "
            f"{reach} tokens back; ")
    if cfg.stream_counts == "protocol":
        return line + (f"each {cfg.K}-step segment starts {first} steps before its drawn step (or at its episode's "
                       f"first) and counts the {cfg.K - first} from it, the steps a standard run of K={cfg.K - first} "
                       "counts (stream_counts=protocol)")
    return line + (f"each {cfg.K}-step segment counts its last {cfg.K - first} steps (from its first exact one), or "
                   "all of it at an episode's first step, so an episode's first steps are counted less often than the papers' "
                   "protocol counts them (stream_counts=tail)")


def stream_exact_batch(batch: Batch, first: int) -> Batch:
    """``batch`` whose ``loss_mask`` counts the real steps from ``first`` on, or all of a segment starting its
    episode."""
    t = batch.timesteps
    ok = (torch.arange(t.shape[1], device=t.device) >= first).unsqueeze(0) | (t[:, :1] == 0)
    return batch._replace(loss_mask=ok if batch.mask is None else ok & batch.mask)


class Carry:
    """Episode chunks (``lanes``) with each lane's recurrent state carried from one chunk to the next: a drop-in
    for the trainer's sampler (``indices``, ``batch``, ``state_dict``) whose batches carry ``state``; the
    trainer hands back each step's end state (``carry``). The state is the stack's recurrent form's for chunks
    of K steps (``DecisionTransformer.chunk_form``), zero where a lane starts an episode."""

    def __init__(self, model, lanes: EpisodeChunks, device):
        self.lanes, self.device = lanes, torch.device(device)
        self.specs = model.chunk_form().specs
        self.state = tuple(s.zeros(lanes.batch_size, self.device) for s in self.specs)
        self._fresh = np.ones(lanes.batch_size, bool)

    def indices(self) -> tuple[np.ndarray, np.ndarray]:
        idx, mask, self._fresh = self.lanes.indices()
        return idx, mask

    def batch(self, idx: np.ndarray) -> Batch:
        """The chunks at ``idx`` with their lanes' state (restarted where ``indices`` began an episode)."""
        fresh = torch.from_numpy(self._fresh).to(self.device)
        return self.lanes.batch(idx)._replace(state=restart_rows(self.specs, self.state, fresh))

    def carry(self, state: tuple) -> None:
        """The state the last batch ended in, which its lanes continue from."""
        self.state = tuple(state)

    def state_dict(self) -> dict:
        return {**self.lanes.state_dict(), "carried": [s.detach().cpu() for s in self.state]}

    def load_state_dict(self, state: dict) -> None:
        self.lanes.load_state_dict(state)
        carried = state.get("carried")
        if not isinstance(carried, list) or len(carried) != len(self.specs) or any(
                not isinstance(t, torch.Tensor) or t.dtype != s.dtype or tuple(t.shape) != (self.lanes.batch_size, *s.shape)
                for t, s in zip(carried, self.specs)):
            raise ValueError("the checkpoint's carried recurrent state does not fit this model's stream state "
                             f"({len(self.specs)} tensors for {self.lanes.batch_size} lanes): it was written by "
                             "another model or batch_size")
        self.state = tuple(t.to(self.device) for t in carried)


@dataclass(frozen=True)
class Fidelity:
    """Whether ``engine``'s actions are the policy a checkpoint was trained as: recompute's are, but for a run trained
    on whole episodes; a stream over whole episodes shows a segment-trained model what no loss measured, unless it
    trained stream-exact."""

    engine: str
    stream_window: int
    """the run's ``stream_window`` (tokens per layer; 0: not windowed)"""
    from_start: bool = False
    """the run trained on episode prefixes (``from_start``)"""
    whole_episodes: bool = False
    """the run trained on whole episodes in chunks carrying the stream's state (``whole_episodes``)"""

    @property
    def exact(self) -> bool:
        if self.engine == "recompute":  # the last K steps from nothing: what segments show, not a whole episode
            return not self.whole_episodes
        return self.stream_window > 0 or self.from_start or self.whole_episodes

    def record(self) -> dict:
        """The fields every evaluation output carries."""
        return {"engine": self.engine, "exact": self.exact, "stream_window": self.stream_window,
                "from_start": self.from_start, "whole_episodes": self.whole_episodes}

    def note(self, what: str = "this checkpoint") -> str | None:
        """One line for a stream that is not the trained policy (None when it is)."""
        if self.exact:
            return None
        if self.whole_episodes:
            return (f"note: {what} is trained on whole episodes (whole_episodes=true), so engine=recompute (the last K "
                    "steps from nothing) is not the policy training optimises, and its scores are not that policy's; "
                    "engine=stream is (exact, O(1) per step)")
        return (f"note: {what} is trained on K-step segments (stream_window=0), so engine=stream (every layer over the whole "
                "episode so far) is not the policy training optimises, and its scores are not that policy's; "
                "engine=recompute is (the papers' protocol), and a run trained with whole_episodes=true streams "
                "exactly, as does one trained with stream_window=W (e.g. stream_window=21 K=40, as far back as "
                "recompute sees) or on episode prefixes (from_start=true K=1000)")


def trained_for_stream(config: dict) -> str:
    """The option that trained a run (its saved ``config``) for the stream, as ``name=value`` ('' : none, a run of
    K-step segments). Such a run is evaluated by the stream unless told otherwise: its stream is the trained policy,
    one step per simulator step, where recompute re-runs K steps each step (and for whole_episodes is not the
    policy at all)."""
    f = fidelity("stream", config)
    return ("whole_episodes=true" if f.whole_episodes else f"stream_window={f.stream_window}" if f.stream_window
            else "from_start=true" if f.from_start else "")


def fidelity(engine: str, config: dict) -> Fidelity:
    """``engine``'s ``Fidelity`` for a checkpoint's saved run ``config`` (none: trained on segments)."""
    w = config.get("stream_window") or 0
    return Fidelity(engine, int(w) if isinstance(w, int) and not isinstance(w, bool) and w > 0 else 0,
                    config.get("from_start") is True, config.get("whole_episodes") is True)
