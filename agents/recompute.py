"""The recompute inference engine: at every environment step, run the model on the last K steps
(the Decision Transformer papers' protocol). Rows keep their own history and length, so finished
episodes restart independently; rows of different lengths are batched with the model's padding
mask (real steps first, padding after)."""

from __future__ import annotations

import torch

from .decision_transformer import Batch


def check_recomputable(model, context: int | None = None) -> int:
    """The context (steps shown to the model) this engine would use, or a ValueError saying why the model
    cannot act with it (a bidirectional layer would see the future)."""
    bad = [f"layer {i} ({spec.attention})" for i, (spec, b) in enumerate(zip(model.stack.specs, model.stack.blocks))
           if not b.attn.causal]
    if not model.stack.causal or bad:
        raise ValueError(f"engine='recompute' needs a causal model (an action must not see the future); "
                         f"{', '.join(bad) or 'the stack'} is bidirectional. Train with causal mechanisms")
    K = int(context or model.cfg.K)
    if K < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    return K


class RecomputeEngine:
    """The model acting for ``batch`` rows aiming at ``target`` ([B] raw returns), with the same
    bookkeeping as the stream step (``agents.decision_transformer.DTStep``): observations normalised
    with ``mean`` / ``std``, returns-to-go divided by ``reward_scale``, timesteps from 0 per row."""

    def __init__(self, model, batch: int, target: torch.Tensor, *, mean: torch.Tensor, std: torch.Tensor,
                 reward_scale: float, context: int | None = None):
        """``context``: steps shown to the model (default: its training context K). A context at
        least the episode length gives "recompute with the full history"."""
        if model.training:
            raise ValueError("RecomputeEngine needs the model in eval mode (model.eval())")
        self.model = model
        self.K = check_recomputable(model, context)
        p = next(model.parameters())
        B, K, cfg = int(batch), self.K, model.cfg
        self.mean, self.std, self.reward_scale = mean, std, float(reward_scale)
        #: the last K steps per row (real steps first), as the model reads them
        self.history = Batch(states=torch.zeros(B, K, cfg.state_dim, device=p.device, dtype=p.dtype),
                             actions=torch.zeros(B, K, cfg.act_dim, device=p.device, dtype=p.dtype),
                             rtg=torch.zeros(B, K, 1, device=p.device, dtype=p.dtype),
                             timesteps=torch.zeros(B, K, dtype=torch.long, device=p.device))
        self.length = torch.zeros(B, dtype=torch.long, device=p.device)  # steps held per row (<= K)
        self._rows = torch.arange(B, device=p.device)
        self._pos = torch.arange(K, device=p.device)
        self.rtg = torch.as_tensor(target, dtype=torch.float32, device=p.device).reshape(B) / self.reward_scale
        self.t = torch.zeros(B, dtype=torch.long, device=p.device)
        self.prev_action = torch.zeros(B, cfg.act_dim, dtype=p.dtype, device=p.device)
        self.first = torch.ones(B, dtype=torch.bool, device=p.device)
        self._any_first = True

    def _buffers(self) -> list[torch.Tensor]:
        return [v for v in self.history if v is not None]

    @torch.inference_mode()
    def reset_rows(self, rows: torch.Tensor, target: torch.Tensor) -> None:
        """Restart the rows where ``rows`` ([B] bool) is True, aiming at ``target`` (one per such row)."""
        self.length[rows] = 0
        for buf in self._buffers():
            buf[rows] = 0
        self.rtg[rows] = target / self.reward_scale
        self.t[rows] = 0
        self.prev_action[rows] = 0
        self.first[rows] = True
        self._any_first = True

    @torch.inference_mode()
    def keep_rows(self, keep: torch.Tensor) -> None:
        """Continue with the rows where ``keep`` ([B] bool) is True only, in order."""
        self.history = Batch(*(None if v is None else v[keep] for v in self.history))
        self.length = self.length[keep]
        self._rows = torch.arange(self.length.shape[0], device=self.length.device)
        self.rtg, self.t, self.prev_action = self.rtg[keep], self.t[keep], self.prev_action[keep]
        self.first = self.first[keep]
        self._any_first = bool(self.first.any())

    @torch.inference_mode()
    def act(self, observation: torch.Tensor, reward: torch.Tensor | None) -> torch.Tensor:
        """Actions [B, act_dim] for raw observations [B, obs_dim] float32 and the previous step's
        rewards [B] float32 (None: zeros; ignored at a row's first step)."""
        if reward is not None:
            self.rtg -= torch.where(self.first, 0.0, reward / self.reward_scale)
        first = self.first if self._any_first else None
        s = ((observation - self.mean) / self.std).to(self.history.states.dtype)
        action = self.step(self.rtg, s, self.prev_action, self.t, first)
        self.prev_action = action.clone()
        self.t += 1
        if self._any_first:
            self.first.zero_()
            self._any_first = False
        return action

    @property
    def timesteps(self) -> torch.Tensor:
        """t per row: steps taken in the row's episode."""
        return self.t

    @property
    def returns_to_go(self) -> torch.Tensor:
        """R_t per row, scaled (as the model reads it)."""
        return self.rtg

    @torch.inference_mode()
    def step(self, rtg, states, prev_actions, timesteps, first):
        """One env step for every row: rtg [B] (scaled), states [B, state_dim] (normalised),
        prev_actions [B, act_dim] (a_{t-1}, written as the previous step's action), timesteps [B] long,
        first [B] bool (rows at t = 0) or None. Returns actions [B, act_dim]."""
        full = self.length == self.K
        h = self.history
        if bool(full.any()):  # drop the oldest step of full rows
            for buf in self._buffers():
                buf[full] = buf[full].roll(-1, dims=1)
        prev = (self.length - 1).clamp(min=0) - full.long()
        has_prev = self.length > 0
        if bool(has_prev.any()):
            i = prev.clamp(min=0)
            h.actions[self._rows[has_prev], i[has_prev]] = prev_actions[has_prev].to(h.actions.dtype)
        pos = torch.where(full, self.length - 1, self.length)
        r = self._rows
        h.states[r, pos] = states.to(h.states.dtype)
        h.rtg[r, pos, 0] = rtg.to(h.rtg.dtype)
        h.timesteps[r, pos] = timesteps
        h.actions[r, pos] = 0  # a_t is not known yet (and the predicting token cannot see it)
        self.length = torch.where(full, self.length, self.length + 1)
        L = int(self.length.max())
        if bool((self.length == L).all()):
            mask = None
        else:
            mask = self._pos[:L].unsqueeze(0) < self.length.unsqueeze(1)
        pred, _ = self.model(Batch(*(None if v is None else v[:, :L] for v in h))._replace(mask=mask))
        return pred[r, self.length - 1]
