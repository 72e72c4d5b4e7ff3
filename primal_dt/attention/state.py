"""The recurrent state of an attention mechanism, with its per-row part declared.

A stream runs B sequences (rows) in lock step, and they end at different times: a finished row must
restart (``reset_rows``) or leave the batch (``select_rows``) without touching the others. What
belongs to a row cannot be guessed from shapes: a value common to the batch may happen to have B
rows (a fused [D, 2D] weight when B == D, a table of B positions), and zeroing or slicing it would
silently corrupt every row. So each mechanism declares the split when it builds its state:

- ``rows``: per-sequence entries, each a batch-first tensor [B, ...] or a nested ``State`` (a
  mechanism built from parts, e.g. the linear family's S/z next to its feature map's statistics,
  nests their states, and each part's own declaration applies to it);
- ``shared``: everything common to the batch (clocks of the lock-stepped rows, precomputed tables,
  fused weights, Python numbers). Never zeroed, never sliced.

Entries are read as ``state[key]`` (a key names one entry, in ``rows`` or in ``shared``). Steps
return a state: a new one (recurrent ``step`` forms) or the same one updated in place (the
preallocated stream forms), so callers always continue with the returned state.

Export forms (base.ExportForm, what agents.export puts in a graph) carry their state as a flat tuple
of tensors instead, each described by a ``StateSpec``: a graph's inputs and outputs are named
tensors, not nested objects. ``State.flat`` / ``State.refill`` convert between the two for a state
whose entries are all per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """One tensor of an export form's state: its ``name``, its ``shape`` per row (the batch axis, first,
    is left out because a graph takes any batch) and ``dtype``. Every entry starts at zero, and a
    restarted row goes back to zero (as ``State.reset_rows`` does), so no initial value is stored; an
    entry ``masked_by`` a flag only needs its flag to go back to zero."""

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
    """Per-row entries (``rows``) and batch-wide ones (``shared``) of one mechanism's recurrent state."""

    def __init__(self, rows: dict | None = None, shared: dict | None = None):
        rows = {} if rows is None else dict(rows)
        shared = {} if shared is None else dict(shared)
        for key, v in rows.items():
            if not (isinstance(v, State) or (isinstance(v, torch.Tensor) and v.dim() >= 1)):
                what = f"a {v.dim()}-d tensor" if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"State: per-row entry {key!r} must be a batch-first tensor [batch, ...] or a "
                                 f"nested State, got {what}; put values common to the batch in shared=")
        both = rows.keys() & shared.keys()
        if both:
            raise ValueError(f"State: {sorted(both)} declared both per-row and shared; an entry is one or the other")
        self.rows, self.shared = rows, shared

    def __getitem__(self, key: str):
        if key in self.rows:
            return self.rows[key]
        if key in self.shared:
            return self.shared[key]
        raise KeyError(f"state has no entry {key!r}; per-row: {sorted(self.rows)}, shared: {sorted(self.shared)}")

    def __repr__(self) -> str:
        rows = ", ".join(f"{k}={tuple(v.shape) if isinstance(v, torch.Tensor) else v!r}" for k, v in self.rows.items())
        return f"State(rows=({rows}), shared={sorted(self.shared)})"

    @staticmethod
    def _check(op: str, sel, key: str | None = None, v: torch.Tensor | None = None) -> None:
        if key is None:
            if not (isinstance(sel, torch.Tensor) and sel.dim() == 1 and sel.dtype == torch.bool):
                what = (f"{sel.dtype} tensor of shape {tuple(sel.shape)}" if isinstance(sel, torch.Tensor)
                        else type(sel).__name__)
                raise ValueError(f"State.{op}: expected a [batch] bool tensor (True = selected row), got {what}")
        elif v.shape[0] != sel.shape[0]:
            raise ValueError(f"State.{op}: per-row entry {key!r} has {v.shape[0]} rows but the selection has "
                             f"{sel.shape[0]}; pass one flag per row of the batch the state was built for")

    def flat(self, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
        """The per-row tensors depth first, as (dotted name, tensor): "kv.sum", "feat.count", ...
        A state with shared entries has no flat form (a graph input is a batch of rows)."""
        if self.shared:
            raise ValueError(f"State.flat: shared entries {sorted(self.shared)} have no per-row flat form")
        out = []
        for key, v in self.rows.items():
            out += v.flat(f"{prefix}{key}.") if isinstance(v, State) else [(prefix + key, v)]
        return out

    def refill(self, tensors) -> State:
        """A state of this one's structure (nested states included, empty ones too) holding ``tensors``
        in ``flat`` order: how an export form turns a graph's state inputs back into its step's state."""
        it = iter(tensors)

        def build(st: State) -> State:
            return State(rows={k: build(v) if isinstance(v, State) else next(it) for k, v in st.rows.items()})

        out = build(self)
        if next(it, None) is not None:
            raise ValueError(f"State.refill: more tensors than the {len(self.flat())} entries of this state")
        return out

    def reset_rows(self, rows: torch.Tensor) -> State:
        """Restart the rows where ``rows`` ([B] bool) is True, in place: their per-row entries become
        zero (False for flags), as in a fresh state; shared entries and other rows are untouched."""
        self._check("reset_rows", rows)
        for key, v in self.rows.items():
            if isinstance(v, State):
                v.reset_rows(rows)
            else:
                self._check("reset_rows", rows, key, v)
                v[rows] = 0
        return self

    def select_rows(self, keep: torch.Tensor) -> State:
        """A new state holding the rows where ``keep`` ([B] bool) is True, in order (a smaller batch:
        finished episodes leave without costing their rows' compute). Shared entries are carried
        over as they are (the new state's own dict, so its clocks advance independently)."""
        self._check("select_rows", keep)
        rows = {}
        for key, v in self.rows.items():
            if isinstance(v, State):
                rows[key] = v.select_rows(keep)
            else:
                self._check("select_rows", keep, key, v)
                rows[key] = v[keep]
        return State(rows, self.shared)
