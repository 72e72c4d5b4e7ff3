"""The Decision Transformer (Chen et al. 2021) on the shared attention stack: the model (its tokens as its
``TokenLayout``, declared in ``agents.token_layouts``, where every token count derives from; its config
``DTConfig`` in ``agents.model_config``), ``DTStep`` (one environment step on explicit state, what the torch
agent runs and ``agents.export`` traces) and the loss.

The stream (``DTStep``). Every environment step feeds ONE chunk (``TokenLayout.chunk``; for the DT
(a_{t-1}, R_t, s_t), the action slot padding at t = 0) through the stack, each token with its own step's
timestep embedding, so over an episode the stream receives exactly ``embed``'s token sequence, cut after
each predicting token. Rows advance in lock step but restart independently (a zero state is a fresh
episode). What a streamed token sees, per layer kind (the *stream semantics*):

- ``primal`` without a window: the running means of q and k over every real token of the episode.
- ``primal`` / ``softmax`` with ``window=w``: the last w token positions, its own included.
- ``softmax`` without a window: a rolling key/value cache treated as ``window = 3K - 1`` tokens
  (``softmax_stream_window``): at the top layer the predicting token sees exactly what recompute
  shows it, but lower layers' outputs came from their own windows, so the receptive field reaches
  further back than recompute's K steps.
- the linear-attention family (linear, performer, cosformer, kerformer, flowformer): prefix sums over
  the episode; a cosformer layer gives NaN for a row once its episode passes ``max_len`` tokens.
- ``kernel-*`` and ``svr-*``: a cache of every real token of the episode (it grows, and so does a
  step's cost; no exported graph).

So for every model, stream == ``streamed_model_equivalent(model).forward`` over the episode so far;
``agents.stream_training`` trains models whose training segments see the same thing.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from envs.sampler import Batch  # noqa: F401  (the DT's batch, re-exported)
from primal_dt.attention.base import StateSpec, restart_rows
from primal_dt.blocks import LayerSpec, Stack
from primal_dt.ksvd import ksvd_objective, ksvd_regularizer

from .model_config import DTConfig
from .ring_writes import write_in_place
from .token_layouts import TOKEN_LAYOUTS, TOKENS, TokenLayout  # noqa: F401  (re-exported: the model's tokens)


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
        for kind in self.tokens.kinds:
            setattr(self, TOKENS[kind].embedding, nn.Linear(TOKENS[kind].size(cfg), d))
        self.embed_ln = nn.LayerNorm(d)
        self.drop = nn.Dropout(cfg.dropout)
        self.stack = Stack(d, cfg.n_heads, cfg.layer_specs(), causal=True, mlp_ratio=cfg.mlp_ratio,
                           dropout=cfg.dropout, norm="pre", activation=cfg.activation)
        self.action_head = nn.Sequential(nn.Linear(d, cfg.act_dim), nn.Tanh())
        self.apply(_init_weights)

    # -- 1. embeddings -----------------------------------------------------------------------------
    def embed_tokens(self, kinds, values, timesteps) -> torch.Tensor:
        """Tokens [..., n, D] of the n ``kinds`` (``timesteps`` [..., n] or [..., 1]): the one embedding, of a
        whole sequence (``embed``) and of a stream chunk."""
        embeds = [getattr(self, TOKENS[k].embedding) for k in kinds]
        x = torch.stack([F.linear(v, e.weight, e.bias) for e, v in zip(embeds, values)], -2)
        x = x + F.embedding(timesteps.clamp(0, self.cfg.max_timestep - 1), self.embed_timestep.weight)
        ln = self.embed_ln  # (modules called functionally: the stream step runs this at every environment step)
        return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)

    def embed(self, batch: Batch) -> torch.Tensor:
        """Interleaved tokens [B, n T, D] in the layout's order: R_1, s_1, a_1, R_2, s_2, a_2, ... for the DT."""
        kinds = self.tokens.kinds
        x = self.embed_tokens(kinds, [getattr(batch, TOKENS[k].field) for k in kinds], batch.timesteps.unsqueeze(-1))
        B, T, n, D = x.shape
        return x.reshape(B, n * T, D)

    # -- 2. the stack and the head ------------------------------------------------------------------
    def predict_action(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of predicting tokens [..., D] -> actions in [-1, 1] [..., act_dim]."""
        return self.action_head(hidden)

    def forward(self, batch: Batch):
        """Predicted action at every step [B, T, act_dim] and the stack's per-layer aux dicts; and, for a batch
        carrying a recurrent ``state`` (episode chunks), the state at its end, third.

        Padding that trails the real steps is invisible to a causal stack, so the stack then runs unmasked
        (its fast paths) and only the aux dicts get the mask (the KSVD regulariser needs it); a carried state
        it reaches is that of a finished episode, which its lane restarts.
        ``batch.trailing`` says so when the producer knows; else the model looks, which reads the mask back
        from the device: a synchronisation a compiled or captured training step must not have.
        """
        x = self.drop(self.embed(batch))
        tmask = self.tokens.token_mask(batch.mask)
        trailing = trailing_padding(batch.mask) if batch.trailing is None else batch.trailing
        predicting = slice(self.tokens.predictor, None, self.tokens.per_step)  # the tokens an action is read from
        if batch.state is None:  # (the top block runs only on the predicting tokens: Stack.forward's rows)
            h, auxes = self.stack(x, None if trailing else tmask, rows=predicting)
        else:  # the stream's own computation, over the chunk: what the stream engine runs, K steps at a time
            h, state, auxes = self.chunk_form().forward_aux(x, batch.state, None if trailing else tmask)
            h = h[:, predicting]
        if tmask is not None:
            for aux in auxes:
                if aux and "mask" in aux:
                    aux["mask"] = tmask
        pred = self.predict_action(h)
        return (pred, auxes) if batch.state is None else (pred, auxes, state)

    def chunk_form(self):
        """The stack's recurrent form as the stream engine builds it (``DTStep``), its rings sized for chunks of K
        steps (shorter ones fit): built per call, as it holds the layers themselves (a copy must not share one)."""
        return self.stack.recurrent(window=softmax_stream_window(self), chunk=self.tokens.per_step * self.cfg.K)

    @property
    def layer_names(self) -> list[str]:
        return [s.attention for s in self.stack.specs]


# -- 3. one environment step on explicit state (the stream) ----------------------------------------
def softmax_stream_window(model) -> int:
    """The window a softmax layer built without one streams over (module docstring): the tokens a predicting
    token sees under recompute with K steps, its own included."""
    tokens = model.tokens
    return max(1, tokens.per_step * (model.cfg.K - 1) + tokens.predictor + 1)


def streamed_model_equivalent(model):
    """A copy of ``model`` whose full-sequence ``forward`` equals what ``DTStep`` computes."""
    twin = copy.deepcopy(model).eval()
    for b in twin.stack.blocks:
        b.attn.adopt_stream_window(softmax_stream_window(model))
    return twin


class StepState(NamedTuple):
    """A ``DTStep``'s state for B rows, by name; a graph takes it ``flat``, in ``DTStep.specs``' order."""

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

        forward(observation [B, obs_dim] raw, reward [B] (the previous step's), reset [B] bool (None: no
                row restarts), target [B] (raw return), *state: ``StepState`` flat) -> (action, *state)

    At a row's first step (t = 0) R = target / reward_scale and the reward is ignored, so the reward that
    ended an episode never leaks into the next; afterwards R -= reward / reward_scale. ``advance`` and
    ``layer_specs`` are what a step on another state overrides (``agents.agent.RecomputeStep``).

    ``inplace``: the caller never passes a state twice, so the layers may write it
    in place (the torch agent: ``agents.ring_writes.write_in_place``)."""

    def __init__(self, model: DecisionTransformer, state_mean, state_std, reward_scale: float, *,
                 inplace: bool = False):
        super().__init__()
        if model.training:
            raise ValueError(f"{type(self).__name__} needs the model in eval mode (model.eval())")
        cfg = model.cfg
        p = next(model.parameters())
        mean, std = (torch.as_tensor(x, dtype=torch.float32, device=p.device) for x in (state_mean, state_std))
        if mean.shape != (cfg.state_dim,) or std.shape != (cfg.state_dim,):
            raise ValueError(f"state_mean / state_std must have shape [{cfg.state_dim}], got "
                             f"{tuple(mean.shape)} / {tuple(std.shape)}")

        self.model = model
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.reward_scale = float(reward_scale)
        self.kinds = [k for k, _ in model.tokens.chunk]
        self.sources = [TOKENS[k].source for k in self.kinds]  # (``STEP_VALUES`` names)
        self.register_buffer("offsets", torch.tensor([dt for _, dt in model.tokens.chunk], device=p.device), False)
        self.specs = [StateSpec("t", (), torch.int64), StateSpec("rtg", (), p.dtype),
                      StateSpec("prev_action", (cfg.act_dim,), p.dtype), *self.layer_specs()]
        if inplace:
            write_in_place(self)
        self.eval()

    def layer_specs(self) -> list[StateSpec]:
        """``StepState.layers``: every layer's recurrent state."""
        self.layers = self.model.stack.recurrent(window=softmax_stream_window(self.model),
                                                 chunk=self.model.tokens.per_step)
        return self.layers.specs

    def init(self, batch: int) -> StepState:
        return StepState.of(s.zeros(batch, self.mean.device) for s in self.specs)

    def forward(self, observation, reward, reset, target, *state):
        if reset is not None:  # (None: no row restarts at this step; the torch agent restarts rows when they end)
            state = restart_rows(self.specs, state, reset)
        t, rtg, prev, layers = StepState.of(state)
        rtg = torch.where(t == 0, target / self.reward_scale, rtg - reward / self.reward_scale)
        s = ((observation - self.mean) / self.std).to(prev.dtype)
        action, layers = self.advance(t, self.values(t, rtg, s, prev, reward), layers)
        return (action, t + 1, rtg, action, *layers)

    def values(self, t, rtg, s, prev, reward) -> dict:
        """The step's values its layout's tokens read, by ``STEP_VALUES`` name, each [B, width]: this step's
        scaled R_t and normalised s_t, the previous step's a_{t-1} and r_{t-1} (0 at a row's first step, whose
        reward input belongs to another episode). Only those the layout reads are computed: the traced step
        holds no operation its tokens do not use."""
        made = {"rtg": lambda: rtg.unsqueeze(-1), "state": lambda: s, "prev_action": lambda: prev,
                "reward": lambda: torch.where(t == 0, 0.0, reward).unsqueeze(-1).to(prev.dtype)}
        return {name: made[name]() for name in self.sources}

    def advance(self, t, values, layers):
        """The action from this step's t and token ``values`` (``values``), and the new layer states."""
        times = t.unsqueeze(1) + self.offsets  # each token's timestep; one before the episode (a_{-1}) is padding
        x = self.model.embed_tokens(self.kinds, [values[src] for src in self.sources], times)
        y, layers = self.layers.forward(x, layers, times >= 0, last_only=True)
        return self.model.predict_action(y[:, -1]), layers


def dt_loss(net, batch: Batch, eta: float, detail: bool = False) -> tuple[torch.Tensor, dict]:
    """Masked action MSE (over ``batch.counted``) + eta * KSVD regulariser, and its parts for logging (and, for
    a batch carrying a recurrent state, ``state``: the state at its end, detached).

    ``net`` is the model or its DistributedDataParallel wrapper: calling the wrapper is what lets DDP
    synchronise gradients. ``detail`` adds J of every primal layer, which only logging steps pay for.
    """
    pred, auxes, *carried = net(batch)
    mse = action_mse(pred, batch.actions, batch.counted)
    reg = ksvd_regularizer(auxes, eta)
    parts = {"mse": mse.detach(), "ksvd": torch.as_tensor(reg, device=mse.device).detach()}
    if carried:  # a batch of episode chunks: the recurrent state its lanes carry on (no gradient through it)
        parts["state"] = tuple(s.detach() for s in carried[0])
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
    """GPT-2 / reference-code init: N(0, 0.02) linear and embedding weights, zero biases (LayerNorms keep
    torch's ones and zeros; Primal-Attention's We, Wr, Lambda, plain parameters, their module's init)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
