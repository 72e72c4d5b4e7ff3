"""The Decision Transformer (Chen et al. 2021) on the shared attention stack.

Read top to bottom:

1. ``DTConfig``: sizes, the stack layout (``dt`` all softmax, ``primal+dt`` last layer primal,
   ``primalformer-dt`` all primal, any registered mechanism, or an explicit per-layer list) and
   per-mechanism options such as Primal-Attention's ``s``.
2. ``embed_tokens``: return-to-go, state and action each get a linear embedding plus a learned
   timestep embedding, then a shared LayerNorm; ``embed`` interleaves them as
   (R_1, s_1, a_1, R_2, s_2, a_2, ...), 3K tokens.
3. ``stack``: the causal ``primal_dt.blocks.Stack`` over those tokens. A segment mask [B, K]
   (real steps first, padding after) becomes a token mask [B, 3K]; see ``forward`` for why
   trailing padding needs no mask inside the stack, only in the losses.
4. ``predict_action``: Linear + tanh on the hidden state of each *state* token, which has seen
   R_t and s_t but not a_t.
5. ``loss``: masked action MSE + eta * KSVD regulariser of the primal layers.

The streaming agent (``agents.stream``) uses the same pieces one environment step at a time:
``embed_step`` builds the step's chunk (a_{t-1}, R_t, s_t), each token with its own step's
timestep embedding; the stack's stream form (``stack.init_stream`` / ``stack.stream_step``)
consumes it, ``stack.reset_rows`` / ``stack.select_rows`` restart or drop finished episodes, and
``predict_action`` reads the state token's output (tests/agents pin that streaming reproduces
``forward`` over the same tokens; the recompute protocol, which re-reads only the last K steps,
is ``agents.recompute``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from primal_dt.blocks import LayerSpec, Stack
from primal_dt.ksvd import ksvd_objective, ksvd_regularizer
from primal_dt.layouts import layout

TOKENS_PER_STEP = 3  # (return-to-go, state, action)
STATE_TOKEN = 1  # offset of the state token within a step


@dataclass
class DTConfig:
    state_dim: int
    act_dim: int
    K: int = 20
    """context length in environment steps (3K tokens)"""
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 3
    layout: str = "primal+dt"
    """dt | primal+dt | primalformer-dt | primal+<mechanism> | a mechanism name"""
    layers: tuple[str, ...] = ()
    """explicit mechanism per layer (overrides layout and n_layers when given)"""
    options: dict = field(default_factory=dict)
    """mechanism name -> constructor options, e.g. {"primal": {"s": 64}}"""
    dropout: float = 0.1
    activation: str = "relu"
    mlp_ratio: float = 4.0
    max_timestep: int = 1000
    """size of the timestep embedding; timesteps are clipped to max_timestep - 1"""

    def layer_specs(self) -> list[LayerSpec]:
        if self.layers:  # one single-layer layout per name: aliases (dt -> softmax) and checks apply
            return [layout(name, 1, self.options)[0] for name in self.layers]
        return layout(self.layout, self.n_layers, self.options)

    def check(self) -> None:
        for name in ("state_dim", "act_dim", "K", "d_model", "n_heads", "n_layers", "max_timestep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {name} must be an integer >= 1, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model dropout must be in [0, 1), got {self.dropout}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"model mlp_ratio must be > 0, got {self.mlp_ratio}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["layers"] = tuple(d.get("layers", ()))
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

    def embed_step(self, rtg, states, prev_actions, timesteps, first):
        """The chunk one environment step adds to a stream: tokens [B, 3, D] = (a_{t-1}, R_t, s_t) and
        their mask [B, 3] (or None).

        rtg [B] (scaled), states [B, state_dim] (normalised), prev_actions [B, act_dim], timesteps [B]
        long (t), first [B] bool (rows at t = 0), or None when no row is at t = 0. The action token
        comes first because a_{t-1} is only known now; it carries timestep t - 1, R_t and s_t carry t.
        Over an episode the stream thus receives exactly ``embed``'s token sequence (R_0, s_0, a_0,
        R_1, ...), cut into chunks one token later. Where ``first``, the action slot is padding
        (masked: invisible to every layer).
        Computes what ``embed_tokens`` computes for those tokens, with the embeddings' weights called
        functionally and one LayerNorm over the stacked three, because it runs every environment step.
        """
        tt = torch.stack((timesteps - 1, timesteps, timesteps), 1).clamp_(0, self.cfg.max_timestep - 1)
        time = F.embedding(tt, self.embed_timestep.weight)
        a = F.linear(prev_actions, self.embed_action.weight, self.embed_action.bias)
        r = torch.addcmul(self.embed_return.bias, rtg.unsqueeze(-1), self.embed_return.weight.squeeze(-1))
        s = F.linear(states, self.embed_state.weight, self.embed_state.bias)
        ln = self.embed_ln
        x = F.layer_norm(torch.stack((a, r, s), 1).add_(time), ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        if first is None:
            return x, None
        mask = torch.ones(x.shape[0], TOKENS_PER_STEP, dtype=torch.bool, device=x.device)
        mask[:, 0] = ~first
        return x, mask

    # -- 2. the stack and the head ------------------------------------------------------------------
    def predict_action(self, hidden_at_state_tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states of state tokens [..., D] -> actions in [-1, 1] [..., act_dim]. ``action_head``'s
        Linear and Tanh called functionally: the stream engine calls this every environment step."""
        head = self.action_head[0]
        return torch.tanh(F.linear(hidden_at_state_tokens, head.weight, head.bias))

    def forward(self, states, actions, rtg, timesteps, mask=None):
        """Predicted action at every step [B, T, act_dim] and the stack's per-layer aux dicts.

        Predictions at padding steps are meaningless (the loss masks them). When all padding
        trails the real steps, as the segment sampler and the evaluators produce it, the causal
        stack cannot see it from any real token, so the stack runs unmasked (its fast paths: about
        4% on a DT step, 6% with a primal layer, on CPU) and the mask is handed to the aux dicts
        only, where the KSVD regulariser needs it. Other padding runs the masked path.
        """
        x = self.drop(self.embed(rtg, states, actions, timesteps))
        tmask = token_mask(mask)
        h, auxes = self.stack(x, None if trailing_padding(mask) else tmask)
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


def dt_loss(net, batch: dict, eta: float, detail: bool = False) -> tuple[torch.Tensor, dict]:
    """Masked action MSE + eta * KSVD regulariser, and its parts for logging (detached).

    ``net`` is the model or its DistributedDataParallel wrapper: calling the wrapper (not
    ``model.loss``) is what lets DDP synchronise gradients. ``detail`` adds J of every primal
    layer (keyed by stack layer index), which costs a little, so only logging steps ask for it.
    """
    pred, auxes = net(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])
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
