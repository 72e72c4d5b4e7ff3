"""Stream-exact training: train on exactly what the stream engine will show the model.

The stream engine computes, at every step, ``model.forward`` over the whole episode so far (see
``agents.stream``). Training sees K-step segments instead. The two agree when

1. every attention layer is windowed (``softmax`` / ``primal`` with ``window=W_l`` tokens), so a
   state token's output depends on a bounded *reach* of R = sum_l (W_l - 1) earlier tokens; and
2. the loss only counts steps whose reach lies inside their segment, i.e. the predicting token of
   step i (token n i + p of the segment, n tokens per step, p the predicting token's offset:
   ``TokenLayout``) has n i + p >= R, or the segment starts at the episode start (timestep 0: there
   is nothing earlier to miss).

Then every counted prediction equals the stream engine's prediction at that step bit for bit up to
float rounding (tests/agents/test_stream_training.py), so the trained objective is the deployed
policy. Segments must be long enough for some steps to count: K >= ``min_segment_steps`` (counted
steps per segment = K - first counted index).

Usage (what the trainer does with ``stream_window``):

    cfg = stream_exact_config(cfg, window=60)                 # DTConfig with every layer windowed
    batch = stream_exact_batch(batch, first_exact_step(cfg))  # its loss_mask: the steps dt_loss counts

Which policy an engine measures (``Fidelity``): recompute (the model on the last K steps) is always the
policy training optimised; the stream is only when the run trained stream-exact. A checkpoint records
this through its config's ``stream_window`` (0: trained on K-step segments), and every evaluation output
carries ``Fidelity.record()`` so a score always says which policy it is of.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from primal_dt.attention import available, get_class
from primal_dt.run.options import attention_words

from .decision_transformer import Batch, DTConfig


def windowed() -> list[str]:
    """The registered mechanisms that take a ``window`` option (softmax, primal, ...)."""
    return [n for n in available() if get_class(n).supports_window]


def stream_exact_options(window: int, options: dict | None = None) -> dict:
    """Mechanism options with ``window`` (tokens) set for every mechanism that takes one."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1 (tokens), got {window!r}")
    out = {k: dict(v) for k, v in (options or {}).items()}
    for name in windowed():
        out.setdefault(name, {})["window"] = window
    return out


def stream_exact_config(cfg: DTConfig, window: int) -> DTConfig:
    """``cfg`` with every attention layer windowed to ``window`` tokens (error if a layer cannot be)."""
    new = dataclasses.replace(cfg, attention_options=attention_words(stream_exact_options(window, cfg.options())))
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
    """Smallest segment step index whose predicting token has its whole reach (``receptive_field``) in the
    segment (``TokenLayout.first_exact_step``)."""
    return cfg_or_model.tokens.first_exact_step(receptive_field(cfg_or_model))


def min_segment_steps(cfg_or_model, counted: int = 1) -> int:
    """Segment length K giving ``counted`` loss-counted steps per segment away from episode starts."""
    return first_exact_step(cfg_or_model) + counted


def stream_exact_loss_mask(timesteps: torch.Tensor, mask: torch.Tensor | None, first: int) -> torch.Tensor:
    """[B, K] bool: real steps whose prediction equals the stream engine's (see module docstring).

    ``timesteps`` [B, K] are the segment's timesteps (a segment starting at timestep 0 starts its
    episode); ``mask`` [B, K] marks real steps (None: all real); ``first``: ``first_exact_step``."""
    B, K = timesteps.shape
    idx = torch.arange(K, device=timesteps.device)
    ok = (idx >= first).unsqueeze(0) | (timesteps[:, :1] == 0)
    return ok if mask is None else ok & mask


def stream_exact_batch(batch: Batch, first: int) -> Batch:
    """``batch`` with its ``loss_mask`` for stream-exact training (``first``: ``first_exact_step``)."""
    return batch._replace(loss_mask=stream_exact_loss_mask(batch.timesteps, batch.mask, first))


@dataclass(frozen=True)
class Fidelity:
    """Whether ``engine``'s actions are the policy a checkpoint was trained as.

    The stream engine computes the model's forward over the whole episode so far; training on K-step
    segments never showed the model that (a softmax layer's cache reaches past K steps through the
    layers below, a primal layer's running means span the episode), so the stream of such a checkpoint
    is a policy no loss ever measured. Recompute shows the model what training showed it."""

    engine: str
    stream_window: int
    """the run's ``stream_window`` (tokens per layer; 0: trained on K-step segments)"""

    @property
    def exact(self) -> bool:
        return self.engine == "recompute" or self.stream_window > 0

    def record(self) -> dict:
        """The fields every evaluation output carries (rollout reports, summaries, exported metadata)."""
        return {"engine": self.engine, "exact": self.exact, "stream_window": self.stream_window}

    def note(self, what: str = "this checkpoint") -> str | None:
        """One line for a stream that is not the trained policy (None when it is)."""
        if self.exact:
            return None
        return (f"note: {what} is trained on K-step segments (stream_window=0), so engine=stream (every layer over the whole "
                "episode so far) is not the policy training optimises, and its scores are not that policy's; "
                "engine=recompute is (the papers' protocol), and a run trained with stream_window=W streams "
                "exactly (e.g. stream_window=10)")


def fidelity(engine: str, config: dict) -> Fidelity:
    """``engine``'s ``Fidelity`` for a checkpoint whose run config (a plain dict, as saved) is ``config``;
    a checkpoint without one (not written by training) counts as trained on segments."""
    w = config.get("stream_window") or 0
    return Fidelity(engine, int(w) if isinstance(w, int) and not isinstance(w, bool) and w > 0 else 0)
