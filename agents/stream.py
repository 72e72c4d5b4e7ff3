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

from .decision_transformer import DTStep


class StreamEngine:
    """``step`` (a ``DTStep``) acting for ``batch`` rows aiming at ``target`` ([B] raw returns)."""

    def __init__(self, step: DTStep, batch: int, target: torch.Tensor):
        self.fn = step
        self.batch = int(batch)
        self.state = step.init(self.batch)
        self.target = torch.as_tensor(target, dtype=torch.float32, device=step.mean.device).reshape(self.batch)
        #: every row is past its episode's first step (``DTStep.advance``'s ``started``)
        self.started = False

    @torch.inference_mode()
    def reset_rows(self, rows: torch.Tensor, target: torch.Tensor) -> None:
        """Restart the rows where ``rows`` ([B] bool) is True, aiming at ``target`` (one per such row)."""
        state = list(self.state)
        for i, s in zip(self.fn.zeroed, self.fn.restart(rows, *(state[i] for i in self.fn.zeroed))):
            state[i] = s
        self.state = tuple(state)
        self.target[rows] = target
        self.started = False

    @torch.inference_mode()
    def keep_rows(self, keep: torch.Tensor) -> None:
        """Continue with the rows where ``keep`` ([B] bool) is True only, in order."""
        self.state = select_rows(self.state, keep)
        self.target = self.target[keep]
        self.batch = int(keep.sum())

    @torch.inference_mode()
    def act(self, observation: torch.Tensor, reward: torch.Tensor | None) -> torch.Tensor:
        """Actions [B, act_dim] for raw observations [B, obs_dim] float32 and the previous step's
        rewards [B] float32 (None: zeros; ignored at a row's first step)."""
        if reward is None:
            reward = torch.zeros(self.batch, device=observation.device)
        action, *state = self.fn.advance(observation, reward, self.target, *self.state, started=self.started)
        state[2] = action.clone()  # prev_action: the caller may write into the returned action
        self.state, self.started = tuple(state), True
        return action

    @property
    def timesteps(self) -> torch.Tensor:
        """t per row: steps taken in the row's episode."""
        return self.state[0]

    @property
    def returns_to_go(self) -> torch.Tensor:
        """R_t per row, scaled (as the model reads it): the target at a row's first step."""
        t, rtg = self.state[:2]
        return torch.where(t == 0, self.target / self.fn.reward_scale, rtg)
