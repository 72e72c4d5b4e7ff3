"""The one contract every attention mechanism honours (see DESIGN.md, "The attention core").

- ``forward(x, mask=None) -> (y, aux)``: ``x`` [B, T, D], ``mask`` [B, T] bool, True = real token.
  Padding never influences a real token's output; outputs at padding positions are zero.
- ``causal`` is fixed at construction.
- Causal mechanisms with a recurrent form also implement ``init_state(batch)`` and
  ``step(x_chunk, state, mask=None) -> (y_chunk, state)``; stepping through a sequence in any
  chunking reproduces ``forward`` on the whole sequence.

States are dicts of batch-first tensors (plus Python ints shared by the batch), so one generic
``reset_rows`` can restart finished episodes independently.
"""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    """Base class: argument checks, head reshaping and state helpers shared by all mechanisms."""

    #: True when ``init_state``/``step`` are implemented (causal mechanisms with a recurrent form).
    supports_step: bool = False
    #: True when the mechanism accepts a ``window`` option.
    supports_window: bool = False
    #: Which directions exist (Nystrom, Linformer, Reformer are bidirectional only).
    supports_causal: bool = True
    supports_bidirectional: bool = True

    def __init__(self, d_model: int, n_heads: int, causal: bool = False):
        super().__init__()
        check_int("d_model", d_model, low=1)
        check_int("n_heads", n_heads, low=1)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.causal = bool(causal)
        if self.causal and not self.supports_causal:
            raise ValueError(f"{type(self).__name__} has no causal form; build it with causal=False")
        if not self.causal and not self.supports_bidirectional:
            raise ValueError(f"{type(self).__name__} is causal only; build it with causal=True")

    # -- argument checks -------------------------------------------------------------------
    def check_input(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        name = type(self).__name__
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: x must have shape [batch, time, d_model={self.d_model}], got {shape}")
        if not x.is_floating_point():
            raise ValueError(f"{name}: x must be a floating-point tensor, got dtype {x.dtype}")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.shape != x.shape[:2]:
                shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise ValueError(f"{name}: mask must have shape [batch, time]={tuple(x.shape[:2])}, got {shape}")
            if mask.dtype != torch.bool:
                raise ValueError(f"{name}: mask must be a bool tensor (True = real token), got dtype {mask.dtype}")

    def _require_step(self) -> None:
        if not (self.causal and self.supports_step):
            raise ValueError(
                f"{type(self).__name__} has no recurrent form when causal={self.causal}; "
                "build it with causal=True (recurrent stepping needs a causal mechanism)"
            )

    # -- reshaping ---------------------------------------------------------------------------
    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H*d] -> [B, H, T, d]"""
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, -1).transpose(1, 2)

    @staticmethod
    def merge_heads(x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, d] -> [B, T, H*d]"""
        B, H, T, d = x.shape
        return x.transpose(1, 2).reshape(B, T, H * d)

    # -- recurrent interface -----------------------------------------------------------------
    def init_state(self, batch: int, device=None, dtype=None) -> dict:
        """Empty recurrent state for ``batch`` sequences (mechanisms with a recurrent form override)."""
        self._require_step()
        raise TypeError(f"{type(self).__name__} sets supports_step but does not define init_state")

    def step(self, x: torch.Tensor, state: dict, mask: torch.Tensor | None = None):
        """Consume a chunk [B, C, D]; returns its outputs and the advanced state."""
        self._require_step()
        raise TypeError(f"{type(self).__name__} sets supports_step but does not define step")

    @staticmethod
    def reset_rows(state: dict, rows: torch.Tensor) -> dict:
        """Restart the sequences selected by ``rows`` ([B] bool) in place: zero their statistics."""
        for v in state.values():
            if isinstance(v, dict):
                Attention.reset_rows(v, rows)
            elif isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows.shape[0]:
                v[rows] = 0
        return state

    @staticmethod
    def select_rows(state: dict, keep: torch.Tensor) -> dict:
        """The state of the sequences selected by ``keep`` ([B] bool), in order: a smaller batch
        (finished episodes leave without costing their rows' compute)."""
        out = {}
        for k, v in state.items():
            if isinstance(v, dict):
                out[k] = Attention.select_rows(v, keep)
            elif isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == keep.shape[0]:
                out[k] = v[keep]
            else:
                out[k] = v
        return out


def zero_padding(y: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero outputs at padding positions ([B, T, D] with mask [B, T])."""
    return y if mask is None else y * mask.unsqueeze(-1).to(y.dtype)


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_window(window) -> int | None:
    if window is None:
        return None
    return check_int("window", window, low=1)
