"""One optimisation step of the Decision Transformer, in the forms ``compile=`` chooses.

``Stepper`` runs forward, loss, backward, clipping and AdamW in one of three forms:
- ``eager`` (the reference): the loss and gradient norm read back every step and checked finite on the host
  before the step is taken;
- ``compile``: forward and loss through ``torch.compile``, AdamW fused, nothing read back per step: a
  non-finite step is skipped on the device by the fused optimizer (``found_inf``) and so is every later
  one, so when the loop reads the flag the weights are those before the first failed step, as in eager;
- ``cudagraphs`` (CUDA only): the ``compile`` step, optimizer included, captured in one CUDA graph after
  a few warm-up steps and replayed, batch and learning rate copied into the graph's fixed buffers.

A batch of episode chunks (``whole_episodes``) carries its lanes' recurrent state in and out: an input of the
step like the batch's tensors (copied into the graph's buffers too), and an output the caller keeps.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from .decision_transformer import Batch, dt_loss

MODES = ("eager", "compile", "cudagraphs")
GRAPH_WARMUP = 3
"""steps in the ``compile`` form before the graph is captured (gradients and optimizer state allocated)"""


def default_mode(device: torch.device, world: int = 1) -> str:
    """What ``compile=auto`` means on ``device``, as measured by ``eval.bench.train --compile`` on the CPU and
    on a GPU (under DDP never graphs: a collective inside a captured graph is not measured)."""
    if device.type != "cuda":
        return "eager"
    return "compile" if world > 1 else "cudagraphs"


def resolve(mode: str, device: torch.device, world: int = 1) -> str:
    """``compile=`` for ``device``: ``auto`` resolved; ``cudagraphs`` off CUDA or under DDP is a ValueError."""
    if mode == "auto":
        return default_mode(device, world)
    if mode == "cudagraphs" and device.type != "cuda":
        raise ValueError(f"compile=cudagraphs needs a CUDA device (this run's is {device}); use compile=compile or "
                         "compile=eager")
    if mode == "cudagraphs" and world > 1:
        raise ValueError(f"compile=cudagraphs runs one process; under DDP ({world} processes) use compile=compile")
    return mode


class Failure(NamedTuple):
    """The first step whose loss or gradient norm was not finite (1-based), and what it computed."""

    step: int
    loss: float
    grad_norm: float
    parts: dict


class Stepper:
    """A run's training step in the form ``mode``; ``failure`` before the loop reads numbers or saves."""

    def __init__(self, mode: str, net, params, opt, sched, eta: float, grad_clip: float, world: int = 1,
                 first_step: int = 0, backend: str = "inductor", graph_after: int = GRAPH_WARMUP,
                 autocast: torch.dtype | None = None):
        if mode not in MODES:
            raise ValueError(f"compile={mode!r}: use one of auto, {', '.join(MODES)}")
        if mode != "eager" and not opt.defaults.get("fused"):
            raise ValueError(f"compile={mode} needs a fused optimizer (skipping a failed step on the device)")
        self.mode, self.net, self.params, self.opt, self.sched = mode, net, params, opt, sched
        self.eager = mode == "eager"
        align(opt, mode)
        self.eta, self.clip, self.world = eta, (grad_clip if grad_clip > 0 else math.inf), world
        self.steps = 0
        self.start, self.graph_after, self.autocast = first_step, max(1, graph_after), autocast
        self._failure: Failure | None = None
        self.graph, self.capturing = None, False
        if not self.eager:
            self.loss_fn = torch.compile(self._loss, backend=backend)
            device = params[0].device
            self.bad = torch.zeros((), device=device)
            """1 once a step failed: every later step is skipped, until the loop reads it"""
            self.count = torch.zeros((), dtype=torch.int64, device=device)
            self.first = torch.full((), -1, dtype=torch.int64, device=device)
            self.snap: dict[str, torch.Tensor] = {}

    def step(self, batch: Batch, detail: bool = False) -> tuple:
        """(loss, grad norm, parts): floats in the eager form, else device tensors (read back when needed)."""
        self.steps += 1
        if self.eager:
            with self._mixed():
                loss, parts = dt_loss(self.net, batch, self.eta, detail)
                self.opt.zero_grad(set_to_none=True)
                loss, gn = map(float, self._backward(loss))
                if math.isfinite(loss) and math.isfinite(gn):
                    self.opt.step()
                    self.sched.step()
                else:
                    self._failure = Failure(self.start + self.steps, loss, gn, parts)
            return loss, gn, parts
        if self.mode == "cudagraphs" and self.steps > self.graph_after:
            return self._replay(batch)
        if self.mode == "compile":
            out = self._device_step(batch)
        else:  # cudagraphs' warm-up, on a side stream as graph capture requires
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self._device_step(batch)
            torch.cuda.current_stream().wait_stream(side)
        self.sched.step()
        return out

    def _loss(self, batch: Batch):
        return dt_loss(self.net, batch, self.eta, True)

    def _mixed(self):
        """``autocast``'s mixed precision where it is set (weights and the optimizer stay float32)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        # no cache of cast weights: a captured graph must not keep tensors a later replay would reuse stale
        return torch.autocast(self.params[0].device.type, dtype=self.autocast, cache_enabled=False)

    def _backward(self, loss):
        """Backward and clipping: (the loss averaged over DDP's processes, the gradient norm), on the device."""
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        stat = loss.detach()
        if self.world > 1:
            stat = stat.clone()
            dist.all_reduce(stat)
            stat = stat / self.world
        return stat, gn

    def _device_step(self, batch: Batch):
        """Forward, backward, clip, the finiteness check and the (possibly skipped) AdamW step, with no
        read-back: what the CUDA graph captures (the scheduler's step is host work, the caller's)."""
        with self._mixed():
            loss, parts = self.loss_fn(batch)
        if not self.capturing:  # captured: the gradients the graph allocated are overwritten by each replay
            self.opt.zero_grad(set_to_none=True)
        stat, gn = self._backward(loss)
        ok = torch.isfinite(stat) & torch.isfinite(gn)
        self.count.add_(1)
        newly = (~ok) & (self.bad == 0)
        self.first.copy_(torch.where(newly, self.count, self.first))
        values = {"loss": stat, "grad_norm": gn.detach(), "mse": parts["mse"], "ksvd": parts["ksvd"]}
        if not self.snap:
            self.snap = {k: torch.zeros((), dtype=torch.float32, device=stat.device) for k in values}
        for k, v in values.items():
            self.snap[k].copy_(torch.where(newly, v.float(), self.snap[k]))
        self.bad.copy_(torch.maximum(self.bad, (~ok).float()))
        self.opt.found_inf = self.bad
        self.opt.step()
        return stat, gn.detach(), parts

    def _replay(self, batch: Batch):
        """The captured step (captured on the first call after the warm-up) on ``batch``."""
        lr = [g["lr"] for g in self.opt.param_groups]
        if self.graph is None:
            self._capture(batch)
        if batch.trailing != self.static.trailing:  # the graph holds one of the model's paths
            raise ValueError("a captured training step takes batches padded as the one it was captured with "
                             f"(trailing padding: {self.static.trailing}); got {batch.trailing}")
        if (batch.state is None) != (self.static.state is None):
            raise ValueError("a captured training step takes batches as the one it was captured with: with a carried "
                             f"recurrent state or without (captured {'with' if self.static.state else 'without'})")
        for held, v in zip(tensors(self.static), tensors(batch)):
            held.copy_(v, non_blocking=True)
        for t, value in zip(self.lr, lr):
            t.fill_(value)
        self.graph.replay()
        self.sched.step()
        stat, gn, parts = self.out
        parts = dict(parts)  # the caller may take entries out (the carried state): the graph's own dict stays whole
        if "state" in parts:  # the graph's output buffers, which the next replay overwrites: the caller keeps copies
            parts["state"] = tuple(s.clone() for s in parts["state"])
        return stat, gn, parts

    def _capture(self, batch: Batch) -> None:
        self.static = Batch(*(v.clone() if isinstance(v, torch.Tensor) else
                              tuple(s.clone() for s in v) if isinstance(v, tuple) else v for v in batch))
        self.lr = [torch.tensor(float(g["lr"]), device=self.bad.device) for g in self.opt.param_groups]
        floats = [g["lr"] for g in self.opt.param_groups]
        for g, t in zip(self.opt.param_groups, self.lr):
            g["lr"] = t  # the graph reads the rate from this tensor; the scheduler keeps writing floats
        self.opt.zero_grad(set_to_none=True)
        self.graph, self.capturing = torch.cuda.CUDAGraph(), True
        try:
            with torch.cuda.graph(self.graph):
                self.out = self._device_step(self.static)
        finally:
            self.capturing = False
        for g, value in zip(self.opt.param_groups, floats):
            g["lr"] = value

    def failure(self) -> Failure | None:
        """The first failed step, or None (one read-back from the device in the compiled forms)."""
        if self.eager or self._failure is not None:
            return self._failure
        if float(self.bad) > 0:
            snap = {k: float(v) for k, v in self.snap.items()}
            self._failure = Failure(self.start + int(self.first), snap["loss"], snap["grad_norm"],
                                    {"mse": torch.tensor(snap["mse"]), "ksvd": torch.tensor(snap["ksvd"])})
        return self._failure


def tensors(batch: Batch):
    """Every tensor of ``batch``, those of a carried recurrent ``state`` included (what a captured graph holds)."""
    for v in batch:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, tuple):
            yield from v


def align(opt: torch.optim.Optimizer, mode: str) -> None:
    """Make ``opt`` run as ``mode`` needs whatever checkpoint it was restored from (a state dict brings back
    the saved run's flags: a run resumed in another form would skip no failed step, or keep its step
    counters on the wrong device)."""
    fused = mode != "eager"
    for g in opt.param_groups:
        g.update(fused=fused, foreach=None if fused else opt.defaults.get("foreach"),
                 capturable=mode == "cudagraphs")
    for p, st in opt.state.items():
        if torch.is_tensor(st.get("step")):
            st["step"] = st["step"].to(p.device if fused else "cpu", torch.float32)

