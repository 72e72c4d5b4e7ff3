"""The recompute engine, the papers' protocol: the model on the last K steps at every environment step.

It is ``DTStep`` (the same bookkeeping) whose state is a K-step history per row instead of the layers'
recurrent states; rows of different lengths are batched with the model's padding mask."""

from __future__ import annotations

import torch

from primal_dt.attention.base import StateSpec

from .decision_transformer import Batch, DTStep


class RecomputeStep(DTStep):
    """``DTStep`` with a history of ``context`` steps (default: the model's K) as its state; a causal model
    only (a bidirectional layer would see the future)."""

    def __init__(self, model, state_mean, state_std, reward_scale: float, *, context: int | None = None):
        stack = model.stack
        bad = [f"layer {i} ({spec.attention})" for i, (spec, b) in enumerate(zip(stack.specs, stack.blocks))
               if not b.attn.causal]
        if not stack.causal or bad:
            raise ValueError(f"engine='recompute' needs a causal model (an action must not see the future); "
                             f"{', '.join(bad) or 'the stack'} is bidirectional. Train with causal mechanisms")
        self.K = int(context or model.cfg.K)  # (a plain attribute: set before Module.__init__ is fine)
        if self.K < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        super().__init__(model, state_mean, state_std, reward_scale)

    def layer_specs(self) -> list[StateSpec]:
        cfg, K = self.model.cfg, self.K
        dtype = next(self.model.parameters()).dtype
        return [StateSpec("history.states", (K, cfg.state_dim), dtype), StateSpec("history.actions", (K, cfg.act_dim), dtype),
                StateSpec("history.rtg", (K, 1), dtype), StateSpec("history.timesteps", (K,), torch.int64),
                StateSpec("history.length", (), torch.int64)]

    def advance(self, t, rtg, s, prev, history):
        states, actions, rtgs, times, length = history
        rows = torch.arange(s.shape[0], device=s.device)
        actions = actions.index_put((rows, (length - 1).clamp(min=0)), prev)  # a_{t-1}, now known (0 at t = 0)
        full = length == self.K

        def shifted(x):  # full rows drop their oldest step
            return torch.where(full.view(-1, *[1] * (x.dim() - 1)), x.roll(-1, 1), x)

        states, actions, rtgs, times = map(shifted, (states, actions, rtgs, times))
        pos = length.clamp(max=self.K - 1)
        states[rows, pos], rtgs[rows, pos, 0], times[rows, pos] = s, rtg.to(rtgs.dtype), t
        actions[rows, pos] = 0  # a_t is not known yet (and the predicting token cannot see it)
        length = (length + 1).clamp(max=self.K)
        L = int(length.max())
        mask = None if bool((length == L).all()) else torch.arange(L, device=s.device) < length.unsqueeze(1)
        pred, _ = self.model(Batch(states[:, :L], actions[:, :L], rtgs[:, :L], times[:, :L], mask=mask))
        return pred[rows, length - 1], (states, actions, rtgs, times, length)
