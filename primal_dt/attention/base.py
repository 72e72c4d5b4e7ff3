"""The one contract every attention mechanism honours (see DESIGN.md, "The attention core").

- ``forward(x, mask=None) -> (y, aux)``: ``x`` [B, T, D], ``mask`` [B, T] bool, True = real token.
  Padding never influences a real token's output; outputs at padding positions are zero.
- ``causal`` is fixed at construction.
- Causal mechanisms with a recurrent form also implement ``init_state(batch)`` and
  ``step(x_chunk, state, mask=None) -> (y_chunk, state)``; stepping through a sequence in any
  chunking reproduces ``forward`` on the whole sequence.
- Their streaming form, ``init_stream(batch, ...)`` and ``stream_step(x_chunk, state, mask=None,
  last_only=False) -> (y, state)``, is what an inference engine runs (agents.stream): the same
  outputs as ``step`` at real tokens (at padding they are unspecified: never read, and padding
  never enters a state), and ``last_only`` asks only for the chunk's last token (y is [B, 1, D]).
  By default it *is* ``step``; a mechanism with a faster form (fused weights, preallocated buffers
  updated in place) overrides both methods, so an engine only loops over layers and never looks at
  a mechanism's type.

States are ``State`` objects (state.py) that declare which entries are per row, so that
``reset_rows`` / ``select_rows`` restart or drop finished sequences without touching anything the
batch shares.

Export form (``export_form(window=None, chunk=1) -> ExportForm``, what agents.export puts in an ONNX /
TorchScript graph): the stream step as a pure function, ``form(x, state, mask=None, last_only=False)
-> (y, state)`` with ``state`` a tuple of tensors laid out by ``form.specs``. A graph is traced once
and then replayed at every step, so an export form keeps nothing on the Python side (no clocks, no
per-phase tables, no in-place updates): every entry is a per-row tensor that comes back new, starts
at zero, and goes back to zero when its row restarts. Its outputs equal ``stream_step``'s at real
tokens (tests/primal_dt/attention/test_export_forms.py). Mechanisms whose recurrent state grows
with the sequence (a cache of every token: kernel-*, svr-*) have none, and say so.
"""

from __future__ import annotations

import torch
from torch import nn

from .precision import check_precision
from .state import State, StateSpec


class Attention(nn.Module):
    """Base class: argument checks, head reshaping and state helpers shared by all mechanisms."""

    #: True when ``init_state``/``step`` are implemented (causal mechanisms with a recurrent form).
    supports_step: bool = False
    #: True when the mechanism accepts a ``window`` option.
    supports_window: bool = False
    #: Which directions exist (Nystrom, Linformer, Reformer are bidirectional only).
    supports_causal: bool = True
    supports_bidirectional: bool = True
    #: Matmul precisions the stream form can run (precision.py); bf16 needs fused weight snapshots.
    stream_precisions: tuple[str, ...] = ("fp32",)

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
    def init_state(self, batch: int, device=None, dtype=None) -> State:
        """Empty recurrent state for ``batch`` sequences (mechanisms with a recurrent form override)."""
        self._require_step()
        raise TypeError(f"{type(self).__name__} sets supports_step but does not define init_state")

    def step(self, x: torch.Tensor, state: State, mask: torch.Tensor | None = None):
        """Consume a chunk [B, C, D]; returns its outputs and the advanced state."""
        self._require_step()
        raise TypeError(f"{type(self).__name__} sets supports_step but does not define step")

    @staticmethod
    def reset_rows(state: State, rows: torch.Tensor) -> State:
        """Restart the sequences selected by ``rows`` ([B] bool) in place: their per-row entries are
        zeroed as declared by the state (see State.reset_rows); shared entries are untouched."""
        return _as_state(state, "reset_rows").reset_rows(rows)

    @staticmethod
    def select_rows(state: State, keep: torch.Tensor) -> State:
        """The state of the sequences selected by ``keep`` ([B] bool), in order: a smaller batch
        (finished episodes leave without costing their rows' compute)."""
        return _as_state(state, "select_rows").select_rows(keep)

    # -- streaming interface (what inference engines run) ---------------------------------------
    def init_stream(self, batch: int, *, device=None, dtype=None, window: int | None = None,
                    chunk: int = 1, precision: str = "fp32") -> State:
        """State of the streaming form for ``batch`` sequences.

        ``window``: a bound the caller imposes on a mechanism whose attention is otherwise unbounded
        and would need a cache of the whole sequence (the DT engine passes 3K - 1 tokens); only
        mechanisms that need a bounded window to stream use it (softmax), a mechanism's own
        ``window`` option wins, and ``adopt_stream_window`` makes ``forward`` compute the same.
        ``chunk``: the chunk length ``stream_step`` will usually get (the DT engine: 3), to size
        preallocated buffers; longer chunks are still correct (processed in pieces).

        ``precision``: the matmul precision of the stream step (precision.py), one of
        ``stream_precisions``; ``dtype`` stays the state's.

        Default: the recurrent form's ``init_state`` (``window`` and ``chunk`` do not apply), fp32 only.
        """
        self.check_stream_precision(precision)
        return self.init_state(batch, device=device, dtype=dtype)

    def check_stream_precision(self, precision: str) -> None:
        """A ValueError when this mechanism's stream form cannot run ``precision``."""
        if check_precision(precision) not in self.stream_precisions:
            raise ValueError(f"{type(self).__name__} streams in {' or '.join(self.stream_precisions)} only, not "
                             f"precision={precision!r}; bf16 covers softmax and primal layers (and every block's MLP)")

    def stream_step(self, x: torch.Tensor, state: State, mask: torch.Tensor | None = None,
                    last_only: bool = False):
        """Consume a chunk [B, C, D] with the state from ``init_stream``; returns (y, state) with y
        [B, C, D], or [B, 1, D] for the chunk's last token when ``last_only`` (the others still
        advance the state). Outputs at padding positions are unspecified. Default: the recurrent
        ``step``."""
        y, state = self.step(x, state, mask)
        return (y[:, -1:] if last_only else y), state

    def adopt_stream_window(self, window: int | None) -> None:
        """Make ``forward`` compute what ``init_stream(..., window=window)`` streams (in place; for a
        copy of a model, see agents.stream.streamed_model_equivalent). Default: nothing to do, the
        stream already equals ``forward``."""

    # -- export form (what agents.export traces into a graph) ------------------------------------
    def export_form(self, *, window: int | None = None, chunk: int = 1) -> ExportForm:
        """The pure stream step (see the module docstring); ``window`` and ``chunk`` (the usual chunk
        length, to size ring buffers) as in ``init_stream``. A snapshot
        of the weights it fuses, like a stream state. Default: none, with the reason as a ValueError."""
        if not (self.causal and self.supports_step):
            raise ValueError(f"{type(self).__name__} has no causal recurrent form (causal={self.causal}), so no "
                             "stream step to export")
        raise ValueError(f"{type(self).__name__}'s recurrent state is a cache of every token of the sequence (it "
                         "grows with the episode), which a graph with fixed-size state tensors cannot hold")


class ExportForm(nn.Module):
    """A mechanism's stream step as a pure function of tensors, for export (see the module docstring).

    ``forward(x [B, C, D], state, mask [B, C] bool or None, last_only) -> (y, new state)``: the
    argument order of ``stream_step``, with ``state`` a tuple of tensors laid out as ``specs``. Each
    mechanism's subclass lives in the mechanism's own file."""

    def __init__(self, specs):
        super().__init__()
        #: the state tensors, in order (per-row shapes; every entry starts at zero)
        self.specs: tuple[StateSpec, ...] = tuple(specs)

    def init(self, batch: int, device=None) -> tuple[torch.Tensor, ...]:
        """A fresh state for ``batch`` rows: zeros, as every export state starts."""
        return tuple(s.zeros(batch, device) for s in self.specs)


class StepExport(ExportForm):
    """The export form of a mechanism whose recurrent ``step`` is already pure with a fixed-size state
    (the linear family: prefix sums S, z and the feature map's statistics): the step itself, its nested
    ``State`` flattened to tensors named by their path ("kv.sum", "feat.count", ...)."""

    def __init__(self, attn: Attention):
        attn._require_step()
        probe = attn.init_state(1)
        flat = probe.flat()
        super().__init__(StateSpec(name, tuple(t.shape[1:]), t.dtype) for name, t in flat)
        self.attn = attn
        self.names = [name for name, _ in flat]
        self.structure = probe  # the nesting to rebuild (its tensors are never read)

    def step(self, x, state: State, mask):
        """The mechanism's step on the rebuilt state (a subclass may adapt it to a graph)."""
        return self.attn.step(x, state, mask)

    def forward(self, x, state, mask=None, last_only: bool = False):
        y, new = self.step(x, self.structure.refill(state), mask)
        out = dict(new.flat())
        return (y[:, -1:] if last_only else y), tuple(out[name] for name in self.names)


def _as_state(state, op: str) -> State:
    if not isinstance(state, State):
        raise ValueError(f"Attention.{op}: expected the State returned by init_state / init_stream / step, got "
                         f"{type(state).__name__}")
    return state


def stream_in_pieces(stream_step, x: torch.Tensor, state: State, mask: torch.Tensor | None, last_only: bool,
                     size: int):
    """Run ``stream_step`` over chunk x [B, C, D] in consecutive pieces of at most ``size`` tokens: how a
    stream form whose preallocated buffers hold ``size`` new tokens takes a longer chunk (same outputs
    as one call, since stepping in any chunking equals the whole sequence)."""
    outs = []
    for i in range(0, x.shape[1], size):
        y, state = stream_step(x[:, i:i + size], state, None if mask is None else mask[:, i:i + size], last_only)
        outs.append(y)
    return (outs[-1] if last_only else torch.cat(outs, 1)), state


def static(n) -> int:
    """A size read from a tensor's shape, as a Python int. Eager code gets the same number; a traced
    graph (agents.export) gets a constant instead of Shape/Gather operators run at every step. Export
    forms use it for every axis but the batch, which they leave dynamic (-1)."""
    return int(n)


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
