"""agents.ring_writes: a softmax ring's write as the torch agent (in place) and the ONNX export (one ScatterND)
run it, the same values as the form's own write, and the forms left as they were once an export is done.
(That an export's graph holds one ScatterND per ring write: tests/agents/test_export.py.)"""

from __future__ import annotations

import numpy as np
import torch

from agents.decision_transformer import DTStep
from agents.ring_writes import rings, scatter_nd_writes, write_in_place
from primal_dt.attention.softmax import SoftmaxRecurrent


def ring_and_chunk(B=3, H=2, R=7, C=3, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ring, new = torch.randn(B, H, R, d, generator=g), torch.randn(B, H, C, d, generator=g)
    at = (torch.randint(0, R, (B, 1, 1, 1), generator=g) + torch.arange(C).view(-1, 1)) % R  # each row's phase
    return ring, at, new


def test_every_write_puts_the_chunk_in_its_slots_and_nothing_else(tiny_dt):
    """The form's write, the in-place one and the ScatterND one give the ring with the chunk at its slots."""
    ring, at, new = ring_and_chunk()
    want = ring.clone()
    for b in range(ring.shape[0]):
        for c in range(new.shape[2]):
            want[b, :, at[b, 0, c, 0]] = new[b, :, c]
    step = DTStep(tiny_dt("dt", K=4, options={}), np.zeros(11), np.ones(11), 10.0)
    form = rings(step)[0]
    plain = form.write(ring, at, new)
    assert torch.equal(plain, want) and not torch.equal(ring, want)  # a copy: the ring given stays as it was
    with scatter_nd_writes(step):
        assert torch.equal(form.write(ring, at, new), want)
    write_in_place(step)
    assert form.write(ring, at, new) is ring and torch.equal(ring, want)


def test_an_export_leaves_each_ring_writing_as_before(tiny_dt):
    """A pure step's rings write with their class's method again after the block, an in-place step's in place:
    exporting a step never changes how it runs afterwards."""
    m = tiny_dt("dt", K=4, options={})
    pure, inplace = (DTStep(m, np.zeros(11), np.ones(11), 10.0, inplace=i) for i in (False, True))
    assert len(rings(pure)) == 3 and all(isinstance(f, SoftmaxRecurrent) for f in rings(pure))
    own = [f.write for f in rings(inplace)]
    for step in (pure, inplace):
        with scatter_nd_writes(step):
            assert all("write" in f.__dict__ and f.write not in own for f in rings(step))
    assert all("write" not in f.__dict__ for f in rings(pure))
    assert [f.write for f in rings(inplace)] == own
