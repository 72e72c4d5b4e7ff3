"""The per-row recurrent state of an attention mechanism, declared once.

A stream runs B sequences (rows) in lock step, and they end at different times: a finished row must
restart or leave the batch without touching the others. So a recurrent form's state holds per-row
tensors only (batch first), each described by a ``StateSpec``, and starts at zero: a row restarts by
going back to zero and leaves by being sliced out (base.restart_rows, base.select_rows). A graph's
inputs and outputs are named tensors, which is why the state is a flat tuple laid out by its specs.

``State`` is how a mechanism built from parts writes its step (the linear family: S/z next to its
feature map's statistics, each part's tensors nested under a name); ``State.flat`` / ``State.refill``
convert it to and from the flat tuple (base.StepRecurrent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """One tensor of a recurrent state: its ``name``, its ``shape`` per row (the batch axis, first, is
    left out because a graph takes any batch; a 0 marks an axis that grows with the sequence) and
    ``dtype``. Every entry starts at zero, and a restarted row goes back to zero, so no initial value is
    stored; an entry ``masked_by`` a flag only needs its flag to go back to zero."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    masked_by: str = ""
    """the name of a bool entry of the same state that marks where this one holds anything: where it is
    False this entry is never read, so a restart zeroes the flag and leaves this entry as it is (a softmax
    layer's keys and values: zeroing them would copy the whole cache at every step of a graph)"""

    def zeros(self, batch: int, device=None) -> torch.Tensor:
        return torch.zeros(batch, *self.shape, dtype=self.dtype, device=device)


class State:
    """Named per-row tensors [B, ...] (or nested ``State``s) of one mechanism's recurrent step."""

    def __init__(self, rows: dict | None = None):
        rows = {} if rows is None else dict(rows)
        for key, v in rows.items():
            if not (isinstance(v, State) or (isinstance(v, torch.Tensor) and v.dim() >= 1)):
                what = f"a {v.dim()}-d tensor" if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"State: per-row entry {key!r} must be a batch-first tensor [batch, ...] or a "
                                 f"nested State, got {what}")
        self.rows = rows

    def __getitem__(self, key: str):
        if key in self.rows:
            return self.rows[key]
        raise KeyError(f"state has no entry {key!r}; entries: {sorted(self.rows)}")

    def __repr__(self) -> str:
        rows = ", ".join(f"{k}={tuple(v.shape) if isinstance(v, torch.Tensor) else v!r}" for k, v in self.rows.items())
        return f"State({rows})"

    def flat(self, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
        """The tensors depth first, as (dotted name, tensor): "kv.sum", "feat.count", ..."""
        out = []
        for key, v in self.rows.items():
            out += v.flat(f"{prefix}{key}.") if isinstance(v, State) else [(prefix + key, v)]
        return out

    def refill(self, tensors) -> State:
        """A state of this one's structure (nested states included, empty ones too) holding ``tensors``
        in ``flat`` order: how a recurrent form turns its tuple state back into its step's state."""
        it = iter(tensors)

        def build(st: State) -> State:
            return State(rows={k: build(v) if isinstance(v, State) else next(it) for k, v in st.rows.items()})

        out = build(self)
        if next(it, None) is not None:
            raise ValueError(f"State.refill: more tensors than the {len(self.flat())} entries of this state")
        return out
