"""How a softmax ring (``primal_dt.attention.softmax.SoftmaxRecurrent``) is written where its runtime knows more
than the form does. The form writes the chunk's keys and values into a copy of its ring (``write``: its plain
math, a pure function of its state); two runtimes replace that write on the step's forms:

- the torch agent never reads a state again once it passed it on, so it writes the ring where it lies
  (``write_in_place``) and saves a copy of every layer's cache per step;
- an ONNX export writes it as one ScatterND operator (``scatter_nd_writes``): torch.export makes a dozen
  broadcasting operators of an indexed assignment, and onnxruntime's ScatterElements (what the form's
  ``scatter`` exports as) reads an index per value instead of per d_head-long slice, slower at large batches.

The forms do not know about either: both replace ``write`` on the form instances of one step module.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from primal_dt.attention.softmax import SoftmaxRecurrent


def rings(step: nn.Module) -> list[SoftmaxRecurrent]:
    """The softmax recurrent forms inside ``step`` (a ``DTStep``, a stack's recurrent form, ...)."""
    return [m for m in step.modules() if isinstance(m, SoftmaxRecurrent)]


def write_in_place(step: nn.Module) -> None:
    """Make every ring of ``step`` write into the state tensor it is given (for a caller that drops it)."""
    for form in rings(step):
        form.write = _in_place


def _in_place(ring, at, new):
    return ring.scatter_(2, at.expand_as(new), new)


@contextlib.contextmanager
def scatter_nd_writes(step: nn.Module):
    """Within the block, every ring of ``step`` writes through ``scatter_nd`` (exported with
    ``onnx_translations``); afterwards each writes as before."""
    forms = rings(step)
    before = [form.__dict__.get("write") for form in forms]  # an instance's own write (None: its class's)
    for form in forms:
        form.write = _scatter_nd_write
    try:
        yield
    finally:
        for form, write in zip(forms, before):
            if write is None:
                del form.write
            else:
                form.write = write


def _scatter_nd_write(ring, at, new):
    """``SoftmaxRecurrent.write`` through ``scatter_nd``: the (row, head, slot) index tuples [B, H, C, 3] of
    [B, H, R, d] made by broadcasting arithmetic (a graph's Expand and Concat cost more)."""
    dev = ring.device
    rows, heads = torch.arange(ring.shape[0], device=dev), torch.arange(ring.shape[1], device=dev)
    axis = torch.eye(3, dtype=torch.int64, device=dev)
    index = rows.view(-1, 1, 1, 1) * axis[0] + heads.view(-1, 1, 1) * axis[1] + at * axis[2]
    return scatter_nd(ring, index, new)


@torch.library.custom_op("primal_dt::scatter_nd", mutates_args=())
def scatter_nd(data: torch.Tensor, index: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """A copy of ``data`` with ``updates`` written at ``data[index]`` (``index`` [..., k]: tuple n names
    ``data[n]``), as one operator that torch.export keeps whole (``onnx_translations``: one ScatterND)."""
    out = data.clone()
    out[index.unbind(-1)] = updates
    return out


@scatter_nd.register_fake
def _(data, index, updates):
    return torch.empty_like(data)


def onnx_translations() -> dict:
    """The ONNX operator of each of this file's torch operators, for ``torch.onnx.export(dynamo=True,
    custom_translation_table=...)`` (agents.export): ``scatter_nd`` is one ScatterND."""
    from onnxscript import opset18 as op

    def scatter_nd_onnx(data, index, updates):
        return op.ScatterND(data, index, updates)

    return {torch.ops.primal_dt.scatter_nd.default: scatter_nd_onnx}
