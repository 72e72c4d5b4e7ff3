"""The streaming inference engine: one Decision-Transformer action per environment step from
per-layer recurrent states, at a cost that does not grow with the episode.

It runs ``agents.decision_transformer.DTStep`` (the one step function, whose module documents what a
streamed token sees) on a state it keeps between calls: B rows in lock step, each restarted or
dropped on its own. The same function is what ``agents.export`` traces, so the exported graph and this
engine compute the same actions.

``precision="bf16"`` runs the stack's weight matmuls in bfloat16 (primal_dt/attention/precision.py:
states, residuals, norms, embeddings and the head stay in the model's dtype); it is not exact, and
opt-in: at batch 100 on a CPU with AVX512-BF16 it halves the step.
"""

from __future__ import annotations

import torch

from primal_dt.attention.base import select_rows

from .decision_transformer import DTStep, StepState


class StreamEngine:
    """``step`` (a ``DTStep``) acting for ``batch`` rows aiming at ``target`` ([B] raw returns). A restarted
    row is flagged and the step zeroes its state at its next ``act``, as an exported graph's caller does."""

    def __init__(self, step: DTStep, batch: int, target: torch.Tensor):
        self.fn = step
        self.batch = int(batch)
        self.state = step.init(self.batch)
        device = step.mean.device
        self.target = torch.as_tensor(target, dtype=torch.float32, device=device).reshape(self.batch)
        self.reset = torch.zeros(self.batch, dtype=torch.bool, device=device)

    @torch.inference_mode()
    def reset_rows(self, rows: torch.Tensor, target: torch.Tensor) -> None:
        """Restart the rows where ``rows`` ([B] bool) is True, aiming at ``target`` (one per such row)."""
        self.reset |= rows
        self.target[rows] = target

    @torch.inference_mode()
    def keep_rows(self, keep: torch.Tensor) -> None:
        """Continue with the rows where ``keep`` ([B] bool) is True only, in order."""
        self.state = StepState.of(select_rows(self.state.flat(), keep))
        self.target, self.reset = self.target[keep], self.reset[keep]
        self.batch = int(keep.sum())

    @torch.inference_mode()
    def act(self, observation: torch.Tensor, reward: torch.Tensor | None) -> torch.Tensor:
        """Actions [B, act_dim] for raw observations [B, obs_dim] float32 and the previous step's
        rewards [B] float32 (None: zeros; ignored at a row's first step)."""
        if reward is None:
            reward = torch.zeros(self.batch, device=observation.device)
        action, *state = self.fn(observation, reward, self.reset, self.target, *self.state.flat())
        # prev_action is the returned action's own tensor: keep a copy, the caller may write into it
        self.state = StepState.of(state)._replace(prev_action=action.clone())
        self.reset.zero_()
        return action

    @property
    def timesteps(self) -> torch.Tensor:
        """t per row: steps taken in the row's episode."""
        return torch.where(self.reset, 0, self.state.t)

    @property
    def returns_to_go(self) -> torch.Tensor:
        """R_t per row, scaled (as the model reads it): the target at a row's first step."""
        return torch.where(self.timesteps == 0, self.target / self.fn.reward_scale, self.state.rtg)
