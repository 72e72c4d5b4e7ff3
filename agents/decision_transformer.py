"""The Decision Transformer (Chen et al. 2021) on the shared attention stack.

Read top to bottom:

1. ``DTConfig``: the model options as the user writes them (``ModelConfig``: sizes, the stack
   layout, ``dt`` all softmax, ``primal+dt`` last layer primal, ``primalformer-dt`` all primal, any
   registered mechanism, or an explicit per-layer list, and per-mechanism options such as
   Primal-Attention's ``s``), plus the data's dimensions and the context length.
2. ``embed_tokens``: return-to-go, state and action each get a linear embedding plus a learned
   timestep embedding, then a shared LayerNorm; ``embed`` interleaves them as
   (R_1, s_1, a_1, R_2, s_2, a_2, ...), 3K tokens.
3. ``stack``: the causal ``primal_dt.blocks.Stack`` over those tokens. A segment mask [B, K]
   (real steps first, padding after) becomes a token mask [B, 3K]; see ``forward`` for why
   trailing padding needs no mask inside the stack, only in the losses.
4. ``predict_action``: Linear + tanh on the hidden state of each *state* token, which has seen
   R_t and s_t but not a_t.
5. ``loss``: masked action MSE + eta * KSVD regulariser of the primal layers.

6. ``DTStep``: the one function that advances B rows by one environment step on explicit state, what
   the torch stream engine (``agents.stream``) runs and ``agents.export`` traces into ONNX / TorchScript
   (the recompute protocol, which re-reads the last K steps, calls ``forward``: ``agents.recompute``).

The stream (``DTStep``). Every environment step feeds ONE chunk of three tokens through the stack,

    (a_{t-1}, R_t, s_t)          (at t = 0 the action slot is padding: masked, invisible),

each token with its own step's timestep embedding (a_{t-1} carries t - 1), so over an episode the
stream receives exactly ``embed``'s token sequence, cut into chunks one token later; only the state
token s_t's top-layer output reaches the action head, and at the top layer the other two tokens only
update the layer's state. Rows (episodes) advance in lock step but restart independently: a row's
state going back to zero is a fresh episode. What a streamed token sees, per layer kind (the *stream
semantics*):

- ``primal`` without a window: the running means of q and k over every real token of the episode
  so far (O(H d) state). This is exactly ``forward`` over the whole episode.
- ``primal`` / ``softmax`` with ``window=w``: the last w token positions (its own included), exactly
  as ``forward`` over the whole episode computes it (a ring of w slots for primal, of w + 2 key/value
  slots for softmax).
- ``softmax`` without a window: a rolling key/value cache, treated as ``window = 3K - 1`` tokens
  (``softmax_stream_window``). At the top layer the state token s_t then attends to exactly the
  tokens the recompute engine shows it (R, s, a of the K - 1 previous steps, then R_t, s_t); lower
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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from primal_dt.attention.base import StateSpec, restart_rows
from primal_dt.blocks import LayerSpec, Stack
from primal_dt.ksvd import ksvd_objective, ksvd_regularizer
from primal_dt.layouts import layout
from primal_dt.train_config import ModelConfig

TOKENS_PER_STEP = 3  # (return-to-go, state, action)
STATE_TOKEN = 1  # offset of the state token within a step


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


def trailing_padding(mask: torch.Tensor | None) -> bool:
    """True when every row is real steps first, then only padding (or when there is no mask)."""
    return mask is None or bool((mask[:, 1:] <= mask[:, :-1]).all())


def token_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Segment mask [B, K] -> token mask [B, 3K]: each step's three tokens share its flag."""
    return None if mask is None else mask.repeat_interleave(TOKENS_PER_STEP, dim=1)


class DecisionTransformer(nn.Module):
    def __init__(self, cfg: DTConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        d = cfg.d_model
        self.embed_timestep = nn.Embedding(cfg.max_timestep, d)
        self.embed_return = nn.Linear(1, d)
        self.embed_state = nn.Linear(cfg.state_dim, d)
        self.embed_action = nn.Linear(cfg.act_dim, d)
        self.embed_ln = nn.LayerNorm(d)
        self.drop = nn.Dropout(cfg.dropout)
        self.stack = Stack(d, cfg.n_heads, cfg.layer_specs(), causal=True, mlp_ratio=cfg.mlp_ratio,
                           dropout=cfg.dropout, norm="pre", activation=cfg.activation)
        self.action_head = nn.Sequential(nn.Linear(d, cfg.act_dim), nn.Tanh())
        self.apply(_init_weights)

    # -- 1. embeddings -----------------------------------------------------------------------------
    def embed_tokens(self, rtg, states, actions, timesteps):
        """Per-kind token embeddings (each [B, T, D]) for T steps, timestep embedding included.

        rtg [B, T, 1], states [B, T, state_dim], actions [B, T, act_dim], timesteps [B, T] long.
        """
        time = self.embed_timestep(timesteps.clamp(0, self.cfg.max_timestep - 1))
        r = self.embed_ln(self.embed_return(rtg) + time)
        s = self.embed_ln(self.embed_state(states) + time)
        a = self.embed_ln(self.embed_action(actions) + time)
        return r, s, a

    def embed(self, rtg, states, actions, timesteps) -> torch.Tensor:
        """Interleaved tokens [B, 3T, D]: R_1, s_1, a_1, R_2, s_2, a_2, ..."""
        r, s, a = self.embed_tokens(rtg, states, actions, timesteps)
        B, T, D = s.shape
        return torch.stack((r, s, a), dim=2).reshape(B, TOKENS_PER_STEP * T, D)

    def embed_step(self, rtg, states, prev_actions, timesteps) -> torch.Tensor:
        """The chunk one environment step adds to a stream: tokens [B, 3, D] = (a_{t-1}, R_t, s_t).

        rtg [B] (scaled), states [B, state_dim] (normalised), prev_actions [B, act_dim], timesteps [B]
        long (t). The action token comes first because a_{t-1} is only known now; it carries timestep
        t - 1, R_t and s_t carry t. Computes what ``embed_tokens`` computes for those tokens, with the
        embeddings' weights called functionally and one LayerNorm over the stacked three, because it
        runs every environment step.
        """
        tt = torch.stack((timesteps - 1, timesteps, timesteps), 1).clamp_(0, self.cfg.max_timestep - 1)
        time = F.embedding(tt, self.embed_timestep.weight)
        a = F.linear(prev_actions, self.embed_action.weight, self.embed_action.bias)
        r = torch.addcmul(self.embed_return.bias, rtg.unsqueeze(-1), self.embed_return.weight.squeeze(-1))
        s = F.linear(states, self.embed_state.weight, self.embed_state.bias)
        ln = self.embed_ln
        return F.layer_norm(torch.stack((a, r, s), 1).add_(time), ln.normalized_shape, ln.weight, ln.bias, ln.eps)

    # -- 2. the stack and the head ------------------------------------------------------------------
    def predict_action(self, hidden_at_state_tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states of state tokens [..., D] -> actions in [-1, 1] [..., act_dim]. ``action_head``'s
        Linear and Tanh called functionally: the stream engine calls this every environment step."""
        head = self.action_head[0]
        return torch.tanh(F.linear(hidden_at_state_tokens, head.weight, head.bias))

    def forward(self, states, actions, rtg, timesteps, mask=None, trailing: bool | None = None):
        """Predicted action at every step [B, T, act_dim] and the stack's per-layer aux dicts.

        Predictions at padding steps are meaningless (the loss masks them). When all padding
        trails the real steps, as the segment sampler and the evaluators produce it, the causal
        stack cannot see it from any real token, so the stack runs unmasked (its fast paths: about
        4% on a DT step, 6% with a primal layer, on CPU) and the mask is handed to the aux dicts
        only, where the KSVD regulariser needs it. Other padding runs the masked path. ``trailing``:
        whether the padding trails, when the caller knows (None: look, which reads the mask back
        from the device, a synchronisation that a compiled or captured training step must not have).
        """
        x = self.drop(self.embed(rtg, states, actions, timesteps))
        tmask = token_mask(mask)
        if trailing is None:
            trailing = trailing_padding(mask)
        h, auxes = self.stack(x, None if trailing else tmask)
        if tmask is not None:
            for aux in auxes:
                if aux and "mask" in aux:
                    aux["mask"] = tmask
        return self.predict_action(h[:, STATE_TOKEN::TOKENS_PER_STEP]), auxes

    # -- 3. the objective ---------------------------------------------------------------------------
    def loss(self, batch: dict, eta: float, detail: bool = False) -> tuple[torch.Tensor, dict]:
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
    """The window a softmax layer built without one streams over: 3K - 1 tokens (module docstring)."""
    return max(1, 3 * model.cfg.K - 1)


def streamed_model_equivalent(model):
    """A copy of ``model`` whose full-sequence ``forward`` equals what ``DTStep`` computes: every layer
    adopts the window the step streams it with (unwindowed softmax: 3K - 1 tokens)."""
    twin = copy.deepcopy(model).eval()
    for b in twin.stack.blocks:
        b.attn.adopt_stream_window(softmax_stream_window(model))
    return twin


class DTStep(nn.Module):
    """One environment step for B rows as one pure function of tensors (module docstring, "The stream"):

        forward(observation [B, obs_dim] raw, reward [B] (the previous step's), reset [B] bool (the row
                starts a new episode now), target [B] (raw return), *state) -> (action [B, act_dim], *state)

    ``state``: ``specs``, ``t`` (timestep), ``rtg`` (the scaled return-to-go), ``prev_action``, then
    every layer's recurrent state (``layer<i>.<name>``); all zero at a fresh row. Inside: rows flagged
    ``reset`` get a zero state (``restart``); a row whose timestep is 0 is at its episode's first step,
    where R = target / reward_scale and the reward is ignored (so the reward that ended an episode never
    leaks into the next), afterwards R -= reward / reward_scale; observations are normalised with the
    dataset's mean / std; the chunk (a_{t-1}, R_t, s_t) goes through the embedding, every layer's
    recurrent form and the action head.

    Built from a model in eval mode; a snapshot of the weights its layers fuse (build a new one after
    the weights change). ``precision``: as ``Attention.recurrent``'s."""

    def __init__(self, model: DecisionTransformer, state_mean, state_std, reward_scale: float, *,
                 precision: str = "fp32"):
        super().__init__()
        if model.training:
            raise ValueError("DTStep needs the model in eval mode (model.eval())")
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
        self.layers = model.stack.recurrent(window=softmax_stream_window(model), chunk=TOKENS_PER_STEP,
                                            precision=precision)
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.reward_scale = float(reward_scale)
        self.specs = [StateSpec("t", (), torch.int64), StateSpec("rtg", (), p.dtype),
                      StateSpec("prev_action", (cfg.act_dim,), p.dtype), *self.layers.specs]
        #: the state tensors a restart zeroes (the others are ``masked_by`` one of these: StateSpec)
        self.zeroed = [i for i, s in enumerate(self.specs) if not s.masked_by]
        self.eval()

    def init(self, batch: int) -> tuple[torch.Tensor, ...]:
        """A fresh state for ``batch`` rows (zeros)."""
        return tuple(s.zeros(batch, self.mean.device) for s in self.specs)

    def forward(self, observation, reward, reset, target, *state):
        state = list(state)
        for i, s in zip(self.zeroed, self.restart(reset, *(state[i] for i in self.zeroed))):
            state[i] = s
        return self.advance(observation, reward, target, *state)

    def restart(self, reset, *state) -> tuple[torch.Tensor, ...]:
        """The given state tensors (the ``zeroed`` ones, in order) with the rows flagged ``reset`` [B]
        zeroed: their episodes start now."""
        return restart_rows([self.specs[i] for i in self.zeroed], state, reset)

    def advance(self, observation, reward, target, *state, started: bool = False):
        """The step on a state whose restarted rows are already zero (``forward`` without ``reset``).

        ``started``: the caller knows that every row is past its episode's first step (the stream engine
        does, from its own resets), so the first-step cases and the chunk's padding mask are left out:
        the same actions with a few operators fewer, which is what a step at batch 1 costs. A graph never
        assumes it."""
        t, rtg, prev = state[:3]
        if started:
            rtg, mask = rtg - reward / self.reward_scale, None
        else:
            first = t == 0
            rtg = torch.where(first, target / self.reward_scale, rtg - reward / self.reward_scale)
            real = t >= 0  # (all True, without a shape computed at every step)
            mask = torch.stack((~first, real, real), 1)  # at t = 0 the action slot is padding
        m = self.model
        s = ((observation - self.mean) / self.std).to(prev.dtype)
        x = m.embed_step(rtg, s, prev, t)
        y, layers = self.layers.forward(x, state[3:], mask, last_only=True)
        action = m.predict_action(y[:, -1])
        return (action, t + 1, rtg, action, *layers)


def dt_loss(net, batch: dict, eta: float, detail: bool = False) -> tuple[torch.Tensor, dict]:
    """Masked action MSE + eta * KSVD regulariser, and its parts for logging (detached).

    ``net`` is the model or its DistributedDataParallel wrapper: calling the wrapper (not
    ``model.loss``) is what lets DDP synchronise gradients. ``detail`` adds J of every primal
    layer (keyed by stack layer index), which costs a little, so only logging steps ask for it.
    """
    pred, auxes = net(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"],
                      trailing=batch.get("trailing"))
    # "loss_mask" (stream-exact training, agents.stream_training) narrows the counted steps
    mse = action_mse(pred, batch["actions"], batch.get("loss_mask", batch["mask"]))
    reg = ksvd_regularizer(auxes, eta)
    parts = {"mse": mse.detach(), "ksvd": torch.as_tensor(reg).detach()}
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
