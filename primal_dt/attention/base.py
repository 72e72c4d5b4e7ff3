"""The one contract every attention mechanism honours (docs/attention.md).

- ``forward(x, mask=None) -> (y, aux)``: ``x`` [B, T, D], ``mask`` [B, T] bool, True = real token.
  Padding never influences a real token's output; outputs at padding positions are zero.
- ``causal`` is fixed at construction.
- A causal mechanism with a recurrent form has ONE: ``recurrent(window=None, chunk=1) -> Recurrent``, a pure
  function of tensors ``form(x_chunk, state, mask=None, last_only=False) -> (y, state)`` (flash-linear-attention's
  shape), its per-row state declared once as ``form.specs``. Stepping a sequence through it in any chunking
  reproduces ``forward`` at every real token (padding never enters a state); ``last_only`` returns only the
  chunk's last token. The stream engine (agents.agent) runs it, TorchScript / ONNX trace it: no other form.

A recurrent state is a tuple of per-row tensors, batch first, starting at zero: a row restarts by going back
to zero (``restart_rows``) and leaves by being sliced out (``select_rows``), so no row leaks into another. A
form keeps nothing on the Python side between calls (a traced graph is replayed at every step). A state that
caches every token (kernel-*, svr-*) streams in torch but has no fixed-size graph state (``Recurrent.grows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class Attention(nn.Module):
    """Base class: argument checks, head reshaping and state helpers shared by all mechanisms."""

    supports_step: bool = False  #: the causal form has a recurrent form (``recurrent``)
    supports_window: bool = False  #: accepts a ``window`` option
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

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H*d] -> [B, H, T, d]
        return x.view(*x.shape[:2], self.n_heads, -1).transpose(1, 2)

    @staticmethod
    def merge_heads(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, d] -> [B, T, H*d]
        B, H, T, d = x.shape
        return x.transpose(1, 2).reshape(B, T, H * d)

    def recurrent(self, *, window: int | None = None, chunk: int = 1) -> Recurrent:
        """This mechanism's recurrent form (module docstring). ``window``: a bound where the state would otherwise
        cache the whole sequence (softmax; a layer's own wins, ``adopt_stream_window`` makes ``forward`` agree);
        ``chunk``: the usual chunk length, to size rings (longer chunks stay correct)."""
        self.check_recurrent()
        raise NotImplementedError(f"{type(self).__name__} declares supports_step but defines no recurrent form")

    def check_recurrent(self) -> None:
        if not (self.causal and self.supports_step):
            raise ValueError(f"{type(self).__name__} has no recurrent form when causal={self.causal}; build it with "
                             "causal=True (recurrent stepping needs a causal mechanism)")

    def adopt_stream_window(self, window: int | None) -> None:
        """Make ``forward`` compute what ``recurrent(window=window)`` streams (in place). Default: nothing."""


@dataclass(frozen=True)
class StateSpec:
    """One tensor of a recurrent state: ``name``, ``shape`` per row (batch left out; a 0 marks an axis that
    grows with the sequence) and ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    masked_by: str = ""
    """a bool entry of the same state marking where this one holds anything; a restart zeroes only the
    flag (a softmax layer's keys and values: zeroing them would copy the whole cache at every step)"""
    shared: str = ""
    """a key under which every form declaring this entry computes it alike from the chunk's length and mask
    alone (a softmax ring's flags and phase): a stack holds one such entry for all its layers"""

    def zeros(self, batch: int, device=None) -> torch.Tensor:
        return torch.zeros(batch, *self.shape, dtype=self.dtype, device=device)


class Recurrent(nn.Module):
    """A mechanism's recurrent form: ``forward(x [B, C, D], state, mask [B, C] bool or None, last_only)
    -> (y, new state)``, ``state`` a tuple of tensors laid out as ``specs`` (module docstring)."""

    def __init__(self, specs):
        super().__init__()
        self.specs: tuple[StateSpec, ...] = tuple(specs)

    @property
    def grows(self) -> bool:  # a cache of every token (module docstring)
        return any(0 in s.shape for s in self.specs)

    def init(self, batch: int, device=None) -> tuple[torch.Tensor, ...]:
        return tuple(s.zeros(batch, device) for s in self.specs)

    def forward_aux(self, x, state, mask=None, last_only: bool = False):
        """``forward`` and what a regulariser reads of the chunk, as the parallel form's aux ({}: nothing)."""
        y, state = self(x, state, mask, last_only)
        return y, state, {}


class ProjectedAttention(Attention):
    """A mechanism between projections ``qkv`` and ``proj``: ``attend(q, k, v, mask, state) -> (y, state)`` on
    [B, H, T, d_head] heads, ``state`` None in the parallel form, else laid out as its ``specs(dtype)``."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, bias: bool = True):
        super().__init__(d_model, n_heads, causal)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def attend(self, q, k, v, mask, state):
        raise NotImplementedError

    def forward(self, x, mask=None):
        self.check_input(x, mask)
        return self.run(x, mask, None)[0], {}

    def run(self, x, mask, state):
        """x [B, T, D] -> (y [B, T, D], state): ``attend`` between the projections."""
        q, k, v = map(self.split_heads, self.qkv(x).split(self.d_model, dim=-1))
        y, state = self.attend(q, k, v, mask, state)
        return zero_padding(self.proj(self.merge_heads(y)), mask), state

    def specs(self, dtype: torch.dtype) -> list[StateSpec]:
        raise NotImplementedError

    def recurrent(self, *, window=None, chunk=1):
        self.check_recurrent()
        return ProjectedRecurrent(self)


class ProjectedRecurrent(Recurrent):
    """The recurrent form of a mechanism whose ``run(x, mask, state)`` takes the state ``specs(dtype)`` declares
    (a ``ProjectedAttention`` whose ``attend`` does): ``run`` on a chunk."""

    def __init__(self, attn: Attention):
        super().__init__(attn.specs(attn.proj.weight.dtype))
        self.attn = attn

    def forward(self, x, state, mask=None, last_only: bool = False):
        y, state = self.attn.run(x, mask, tuple(state))
        return (y[:, -1:] if last_only else y), state


def restart_rows(specs, state, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``state`` with the rows flagged in ``rows`` [B] bool back at zero, as tensor arithmetic an exported graph
    runs too; an entry ``masked_by`` a flag passes unchanged."""
    def zeroed(s):  # onnxruntime has no Where for bool tensors: flags are cleared with And
        r = rows.view(-1, *[1] * (s.dim() - 1))
        return s & ~r if s.dtype == torch.bool else torch.where(r, 0, s)

    return tuple(s if spec.masked_by else zeroed(s) for spec, s in zip(specs, state))


def select_rows(state, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(s[keep] for s in state)


def stream_in_pieces(form, x: torch.Tensor, state, mask: torch.Tensor | None, last_only: bool, size: int):
    """Run ``form`` over chunk x [B, C, D] in pieces of at most ``size`` tokens (what its ring holds)."""
    outs = []
    for i in range(0, x.shape[1], size):
        y, state = form(x[:, i:i + size], state, None if mask is None else mask[:, i:i + size], last_only)
        outs.append(y)
    return (outs[-1] if last_only else torch.cat(outs, 1)), state


def static(n) -> int:
    """A size read from a tensor's shape as a Python int: a traced graph gets a constant instead of
    Shape/Gather operators run at every step (recurrent forms use it for every axis but the batch)."""
    return int(n)


def zero_padding(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, *F] with the padding positions of ``mask`` [B, T] zeroed."""
    return x if mask is None else x * mask.view(*mask.shape, *([1] * (x.dim() - 2))).to(x.dtype)


def check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def check_window(window) -> int | None:
    return None if window is None else check_int("window", window, low=1)
