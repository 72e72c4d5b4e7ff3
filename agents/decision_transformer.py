"""The Decision Transformer (Chen et al. 2021) on the shared attention stack.

Read top to bottom: ``DTConfig`` (the model options as the user writes them, plus the data's dimensions
and the context K); ``TokenLayout`` (the tokens each step contributes and the one that predicts the
action: every token count derives from it; ``dt``: (R_t, s_t, a_t), ``bc``: (s_t, a_t)); the model
(``embed`` interleaves a ``Batch``'s tokens, the causal stack, ``predict_action`` reads each predicting
token); the loss (masked action MSE + eta * KSVD); ``DTStep``, one environment step for B rows on
explicit state (``StepState``), what the torch agent runs and ``agents.export`` traces (the recompute
protocol, ``agents.recompute``, is the same step with the last K steps as its state).

The stream (``DTStep``). Every environment step feeds ONE chunk (``TokenLayout.chunk``) through the
stack, for the DT

    (a_{t-1}, R_t, s_t)          (at t = 0 the action slot is padding: masked, invisible),

each token with its own step's timestep embedding (a_{t-1} carries t - 1), so over an episode the
stream receives exactly ``embed``'s token sequence, cut after each predicting token; only the state
token s_t's top-layer output reaches the action head, and at the top layer the other tokens only
update the layer's state. Rows (episodes) advance in lock step but restart independently: a row's
state going back to zero is a fresh episode. What a streamed token sees, per layer kind (the *stream
semantics*):

- ``primal`` without a window: the running means of q and k over every real token of the episode
  so far (O(H d) state). This is exactly ``forward`` over the whole episode.
- ``primal`` / ``softmax`` with ``window=w``: the last w token positions (its own included), exactly
  as ``forward`` over the whole episode computes it (a ring of w slots for primal, of w + 2 key/value
  slots for softmax).
- ``softmax`` without a window: a rolling key/value cache, treated as ``window = 3K - 1`` tokens
  (``softmax_stream_window``; ``TokenLayout.stream_window`` for other layouts). At the top layer the
  state token s_t then attends to exactly the tokens the recompute engine shows it (R, s, a of the
  K - 1 previous steps, then R_t, s_t); lower
  layers' outputs inside that window were themselves computed from their own windows, so the
  receptive field reaches further back than recompute's K steps.
- linear-attention family (linear, performer, cosformer, kerformer, flowformer): their own
  recurrent state (prefix sums over the whole episode, constant size), i.e. ``forward`` over the
  episode. A cosformer layer gives NaN for a row once its episode passes ``max_len`` tokens.
- ``kernel-*`` and ``svr-*``: their recurrent state is a cache of every real token of the episode
  (it grows with the episode, and so does a step's cost; no exported graph), i.e. ``forward``.

So for every model, stream == ``streamed_model_equivalent(model).forward`` over the episode so far
(the copy whose unwindowed softmax layers get ``window = 3K - 1``); ``agents.stream_training`` trains
models whose training segments see the same thing.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from envs.sampler import Batch  # noqa: F401  (the DT's batch, re-exported)
from primal_dt.attention.base import StateSpec, restart_rows
from primal_dt.blocks import LayerSpec, Stack
from primal_dt.ksvd import ksvd_objective, ksvd_regularizer
from primal_dt.layouts import layout
from agents.train_config import ModelConfig



@dataclass(frozen=True)
class TokenLayout:
    """The tokens one environment step contributes to the sequence, in order, and the token whose
    top-layer output predicts the step's action (it must come before the action token, which it may
    not see). Every token count of the package derives from this: tokens per step, the predicting
    token's offset, the stream chunk, the unwindowed softmax's stream window."""

    kinds: tuple[str, ...]
    """token kinds per step, in sequence order: ``rtg`` (return-to-go), ``state``, ``action``"""
    predict_from: str = "state"

    def __post_init__(self):
        unknown = set(self.kinds) - set(EMBEDDED)
        if unknown or len(set(self.kinds)) != len(self.kinds) or self.predict_from not in self.kinds:
            raise ValueError(f"a token layout names distinct kinds among {', '.join(EMBEDDED)} and predicts from "
                             f"one of them, got {self.kinds} predicting from {self.predict_from!r}")
        if self.kinds[self.predictor + 1:] != ("action",):
            raise ValueError(f"the action token must directly follow the predicting token and end the step, got "
                             f"{self.kinds} predicting from {self.predict_from!r}")

    @property
    def per_step(self) -> int:
        """tokens per environment step"""
        return len(self.kinds)

    @property
    def predictor(self) -> int:
        """offset of the predicting token within its step"""
        return self.kinds.index(self.predict_from)

    @property
    def chunk(self) -> tuple[tuple[str, int], ...]:
        """What one stream step feeds the stack, as (kind, timestep offset): the tokens after the previous
        step's predicting token (its action: known only now, offset -1), then this step's tokens up to its
        own predicting token (offset 0). Over an episode the chunks are the sequence, cut after each
        predicting token."""
        p = self.predictor
        return (*((k, -1) for k in self.kinds[p + 1:]), *((k, 0) for k in self.kinds[:p + 1]))

    def token_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """Segment mask [B, K] -> token mask [B, per_step * K]: each step's tokens share its flag."""
        return None if mask is None else mask.repeat_interleave(self.per_step, dim=1)

    def at_predictors(self, h: torch.Tensor) -> torch.Tensor:
        """The predicting tokens' rows [B, K, D] of a token sequence h [B, per_step * K, D]."""
        return h[:, self.predictor::self.per_step]

    def stream_window(self, K: int) -> int:
        """Tokens a predicting token sees under recompute with K steps: the K - 1 previous steps' tokens,
        then this step's up to itself."""
        return max(1, self.per_step * (K - 1) + self.predictor + 1)

    def first_exact_step(self, reach: int) -> int:
        """Smallest segment step i whose predicting token (per_step * i + predictor) has ``reach``
        earlier tokens inside the segment."""
        return max(0, math.ceil((reach - self.predictor) / self.per_step))


EMBEDDED = {"rtg": "embed_return", "state": "embed_state", "action": "embed_action"}
"""token kind -> the model's embedding module (its name is the checkpoint's parameter name)"""
FIELDS = {"rtg": "rtg", "state": "states", "action": "actions"}
"""token kind -> the ``Batch`` field holding its values"""
TOKEN_LAYOUTS = {
    "dt": TokenLayout(("rtg", "state", "action")),  # the Decision Transformer: conditioned on the return-to-go
    "bc": TokenLayout(("state", "action")),  # behaviour cloning (Chen et al. 2021's transformer baseline)
}
"""Model names whose token layout is not the Decision Transformer's (every other name: ``dt``'s)."""


@dataclass(kw_only=True)
class DTConfig(ModelConfig):
    """The network: the model options exactly as the user writes them (``ModelConfig``, ``model.*`` on
    the command line, every check of theirs in it), plus what the data and the run fix: the
    dimensions, the context and the timestep range."""

    state_dim: int
    act_dim: int
    K: int = 20
    """context length in environment steps (3K tokens)"""
    max_timestep: int = 1000
    """size of the timestep embedding; timesteps are clipped to max_timestep - 1"""

    def layer_specs(self) -> list[LayerSpec]:
        options = self.options()
        if self.layer_names():  # one single-layer layout per name: aliases (dt -> softmax) and checks apply
            return [layout(name, 1, options)[0] for name in self.layer_names()]
        return layout(self.name, self.n_layers, options)

    def check(self) -> None:
        """The fields this config adds; then the model options' own checks (``ModelConfig.check``)."""
        for name in ("state_dim", "act_dim", "K", "max_timestep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {name} must be an integer >= 1, got {v!r}")
        super().check()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DTConfig":
        """Back from ``to_dict``; a missing or unknown field is a TypeError naming it, and a field whose value
        is not of its default's kind (a list for ``layers``, a string for ``d_model``) a ValueError naming it."""
        kinds = {int: (int,), float: (int, float), str: (str,), bool: (bool,), tuple: (list, tuple)}
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            want = kinds.get(type(default))
            v = d.get(f.name)
            if f.name in d and want and (not isinstance(v, want) or (isinstance(v, bool) and bool not in want)):
                raise ValueError(f"model_config.{f.name} must be {type(default).__name__}, got {json.dumps(v)[:40]}")
        return cls(**d)

    @property
    def tokens(self) -> TokenLayout:
        """The token layout (``TOKEN_LAYOUTS``: by model name, ``primal+<name>`` too; the Decision
        Transformer's by default)."""
        return TOKEN_LAYOUTS.get(self.name.removeprefix("primal+"), TOKEN_LAYOUTS["dt"])


def trailing_padding(mask: torch.Tensor | None) -> bool:
    """True when every row is real steps first, then only padding (or when there is no mask)."""
    return mask is None or bool((mask[:, 1:] <= mask[:, :-1]).all())


class DecisionTransformer(nn.Module):
    def __init__(self, cfg: DTConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.tokens = cfg.tokens
        d = cfg.d_model
        self.embed_timestep = nn.Embedding(cfg.max_timestep, d)
        dims = {"rtg": 1, "state": cfg.state_dim, "action": cfg.act_dim}
        for kind in self.tokens.kinds:
            setattr(self, EMBEDDED[kind], nn.Linear(dims[kind], d))
        self.embed_ln = nn.LayerNorm(d)
        self.drop = nn.Dropout(cfg.dropout)
        self.stack = Stack(d, cfg.n_heads, cfg.layer_specs(), causal=True, mlp_ratio=cfg.mlp_ratio,
                           dropout=cfg.dropout, norm="pre", activation=cfg.activation)
        self.action_head = nn.Sequential(nn.Linear(d, cfg.act_dim), nn.Tanh())
        self.apply(_init_weights)

    # -- 1. embeddings -----------------------------------------------------------------------------
    def embed_tokens(self, kinds, values, timesteps) -> torch.Tensor:
        """Tokens [..., n, D] of the n ``kinds``: each kind's linear embedding of its value (``values``, each
        [..., dim of the kind]) plus the learned embedding of its timestep (``timesteps`` [..., n], or
        [..., 1] for one shared timestep; clipped to max_timestep - 1), then the shared LayerNorm. The one
        embedding: of a whole sequence (``embed``) and of a stream step's chunk (``DTStep``)."""
        embeds = [getattr(self, EMBEDDED[k]) for k in kinds]
        x = torch.stack([F.linear(v, e.weight, e.bias) for e, v in zip(embeds, values)], -2)
        x = x + F.embedding(timesteps.clamp(0, self.cfg.max_timestep - 1), self.embed_timestep.weight)
        ln = self.embed_ln  # (modules called functionally: the stream step runs this at every environment step)
        return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)

    def embed(self, batch: Batch) -> torch.Tensor:
        """Interleaved tokens [B, n T, D] in the layout's order: R_1, s_1, a_1, R_2, s_2, a_2, ... for the DT."""
        kinds = self.tokens.kinds
        x = self.embed_tokens(kinds, [getattr(batch, FIELDS[k]) for k in kinds], batch.timesteps.unsqueeze(-1))
        B, T, n, D = x.shape
        return x.reshape(B, n * T, D)

    # -- 2. the stack and the head ------------------------------------------------------------------
    def predict_action(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of predicting tokens [..., D] -> actions in [-1, 1] [..., act_dim] (``action_head``'s
        Linear and Tanh called functionally, as ``embed_tokens``)."""
        head = self.action_head[0]
        return torch.tanh(F.linear(hidden, head.weight, head.bias))

    def forward(self, batch: Batch):
        """Predicted action at every step [B, T, act_dim] and the stack's per-layer aux dicts.

        Predictions at padding steps are meaningless (the loss masks them). When all padding
        trails the real steps, as the segment sampler and the evaluators produce it, the causal
        stack cannot see it from any real token, so the stack runs unmasked (its fast paths) and the
        mask is handed to the aux dicts only, where the KSVD regulariser needs it. Other padding runs
        the masked path. ``batch.trailing`` says whether the padding trails when the producer knows (the
        sampler does); else the model looks, which reads the mask back from the device: a
        synchronisation that a compiled or captured training step must not have.
        """
        x = self.drop(self.embed(batch))
        tmask = self.tokens.token_mask(batch.mask)
        trailing = trailing_padding(batch.mask) if batch.trailing is None else batch.trailing
        h, auxes = self.stack(x, None if trailing else tmask)
        if tmask is not None:
            for aux in auxes:
                if aux and "mask" in aux:
                    aux["mask"] = tmask
        return self.predict_action(self.tokens.at_predictors(h)), auxes

    # -- 3. the objective ---------------------------------------------------------------------------
    def loss(self, batch: Batch, eta: float, detail: bool = False) -> tuple[torch.Tensor, dict]:
        return dt_loss(self, batch, eta, detail)

    # -- inspection -----------------------------------------------------------------------------
    def primal_layers(self) -> dict[int, nn.Module]:
        """Layer index -> attention module for every layer that has a KSVD Lambda."""
        return {i: b.attn for i, b in enumerate(self.stack.blocks) if hasattr(b.attn, "Lambda")}

    @property
    def layer_names(self) -> list[str]:
        return [s.attention for s in self.stack.specs]


# -- 4. one environment step on explicit state (the stream) ----------------------------------------
def softmax_stream_window(model) -> int:
    """The window a softmax layer built without one streams over: what recompute shows the predicting
    token (``TokenLayout.stream_window``; module docstring)."""
    return model.tokens.stream_window(model.cfg.K)


def streamed_model_equivalent(model):
    """A copy of ``model`` whose full-sequence ``forward`` equals what ``DTStep`` computes: every layer
    adopts the window the step streams it with (unwindowed softmax: ``softmax_stream_window``)."""
    twin = copy.deepcopy(model).eval()
    for b in twin.stack.blocks:
        b.attn.adopt_stream_window(softmax_stream_window(model))
    return twin


class StepState(NamedTuple):
    """A ``DTStep``'s state for B rows, by name; a graph takes it ``flat``, in ``DTStep.specs``' order. All
    zero at a fresh row."""

    t: torch.Tensor
    """[B] int64: steps taken in the row's episode (0: its next step is its first)"""
    rtg: torch.Tensor
    """[B]: the return-to-go R_t / reward_scale of the row's last step"""
    prev_action: torch.Tensor
    """[B, act_dim]: the row's last action (a_{t-1})"""
    layers: tuple[torch.Tensor, ...]
    """every layer's recurrent state tensors (``layer<i>.<name>``; recompute: the K-step history)"""

    def flat(self) -> tuple[torch.Tensor, ...]:
        return (self.t, self.rtg, self.prev_action, *self.layers)

    @classmethod
    def of(cls, flat) -> "StepState":
        t, rtg, prev_action, *layers = flat
        return cls(t, rtg, prev_action, tuple(layers))


class DTStep(nn.Module):
    """One environment step for B rows as one pure function of tensors (module docstring, "The stream"):

        forward(observation [B, obs_dim] raw, reward [B] (the previous step's), reset [B] bool (the row
                starts a new episode now; None: no row does), target [B] (raw return), *state)
                -> (action [B, act_dim], *state)

    ``state``: a ``StepState`` flat (``specs``), all zero at a fresh row. Inside: rows flagged ``reset`` get
    a zero state; a row whose timestep is 0 is at its episode's first step, where R = target / reward_scale
    and the reward is ignored (so the reward that ended an episode never leaks into the next), afterwards
    R -= reward / reward_scale; observations are normalised with the dataset's mean / std; the chunk
    (``TokenLayout.chunk``: (a_{t-1}, R_t, s_t) for the DT) goes through the embedding, every layer's
    recurrent form and the action head (``advance``: what a step on another state overrides, with
    ``layer_specs``, as ``agents.recompute`` does).

    Built from a model in eval mode; it holds the weights its layers multiply by detached (in-place updates
    show; build a new one after the parameters are replaced, as ``.to(device)`` does). ``inplace``: the caller
    never passes a state twice, so the layers may write it in place (``Recurrent.inplace``: the torch agent)."""

    def __init__(self, model: DecisionTransformer, state_mean, state_std, reward_scale: float, *,
                 inplace: bool = False):
        super().__init__()
        if model.training:
            raise ValueError(f"{type(self).__name__} needs the model in eval mode (model.eval())")
        cfg = model.cfg
        p = next(model.parameters())
        mean = torch.as_tensor(state_mean, dtype=torch.float32, device=p.device)
        std = torch.as_tensor(state_std, dtype=torch.float32, device=p.device)
        if mean.shape != (cfg.state_dim,) or std.shape != (cfg.state_dim,):
            raise ValueError(f"state_mean / state_std must have shape [{cfg.state_dim}], got "
                             f"{tuple(mean.shape)} / {tuple(std.shape)}")
        if not reward_scale > 0:
            raise ValueError(f"reward_scale must be > 0, got {reward_scale}")
        self.model = model
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.reward_scale, self.inplace = float(reward_scale), inplace
        self.kinds = [k for k, _ in model.tokens.chunk]
        self.register_buffer("offsets", torch.tensor([dt for _, dt in model.tokens.chunk], device=p.device), False)
        self.specs = [StateSpec("t", (), torch.int64), StateSpec("rtg", (), p.dtype),
                      StateSpec("prev_action", (cfg.act_dim,), p.dtype), *self.layer_specs()]
        self.eval()

    def layer_specs(self) -> list[StateSpec]:
        """The state past the bookkeeping (``StepState.layers``): every layer's recurrent state."""
        self.layers = self.model.stack.recurrent(window=softmax_stream_window(self.model),
                                                 chunk=self.model.tokens.per_step, inplace=self.inplace)
        return self.layers.specs

    def init(self, batch: int) -> StepState:
        """A fresh state for ``batch`` rows (zeros)."""
        return StepState.of(s.zeros(batch, self.mean.device) for s in self.specs)

    def forward(self, observation, reward, reset, target, *state):
        if reset is not None:  # (None: no row restarts at this step; the torch agent restarts rows when they end)
            state = restart_rows(self.specs, state, reset)
        t, rtg, prev, layers = StepState.of(state)
        rtg = torch.where(t == 0, target / self.reward_scale, rtg - reward / self.reward_scale)
        s = ((observation - self.mean) / self.std).to(prev.dtype)
        action, layers = self.advance(t, rtg, s, prev, layers)
        return (action, t + 1, rtg, action, *layers)

    def advance(self, t, rtg, s, prev, layers):
        """The action from this step's values (t, scaled R_t, normalised s_t, a_{t-1}), and the new layer
        states: the chunk through every layer's recurrent form."""
        now = {"rtg": rtg.unsqueeze(-1), "state": s}  # this step's values; the previous step's is its action
        times = t.unsqueeze(1) + self.offsets  # each token's timestep; one before the episode (a_{-1}) is padding
        x = self.model.embed_tokens(self.kinds, [prev if dt else now[k] for k, dt in self.model.tokens.chunk], times)
        y, layers = self.layers.forward(x, layers, times >= 0, last_only=True)
        return self.model.predict_action(y[:, -1]), layers


def dt_loss(net, batch: Batch, eta: float, detail: bool = False) -> tuple[torch.Tensor, dict]:
    """Masked action MSE + eta * KSVD regulariser, and its parts for logging (detached).

    ``net`` is the model or its DistributedDataParallel wrapper: calling the wrapper (not
    ``model.loss``) is what lets DDP synchronise gradients. ``detail`` adds J of every primal
    layer (keyed by stack layer index), which costs a little, so only logging steps ask for it.
    The MSE counts ``batch.counted`` (stream-exact training, ``agents.stream_training``, narrows it).
    """
    pred, auxes = net(batch)
    mse = action_mse(pred, batch.actions, batch.counted)
    reg = ksvd_regularizer(auxes, eta)
    parts = {"mse": mse.detach(), "ksvd": torch.as_tensor(reg, device=mse.device).detach()}
    for i, aux in enumerate(auxes if detail else ()):
        if aux and "Lambda" in aux:
            parts[f"J/layer{i}"] = ksvd_objective(aux).detach().mean()
    return mse + reg, parts


def action_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean squared error over real steps and action dimensions (padding steps excluded)."""
    if mask is None:
        return F.mse_loss(pred, target)
    m = mask.unsqueeze(-1).to(pred.dtype)
    return ((pred - target) ** 2 * m).sum() / (m.sum() * pred.shape[-1]).clamp(min=1)


def _init_weights(module: nn.Module) -> None:
    """GPT-2 / reference-code init: N(0, 0.02) linear and embedding weights, zero biases.

    Primal-Attention's We, Wr, Lambda are plain parameters, not Linear layers, so they keep the
    orthogonal / uniform init of their module.
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
