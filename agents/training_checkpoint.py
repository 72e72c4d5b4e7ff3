"""The trainer's side of the DT checkpoint: what it writes, and how a resumed run continues exactly.

The file's layout is ``agents.dt_checkpoint``'s (the one writer and reader); this module decides
what goes into it from a run (weights, config, data statistics, optimizer, scheduler, every
process's random streams, progress) and puts it back into a run.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from primal_dt.monitor import RunMonitor

from . import dt_checkpoint, training_log
from .dt_checkpoint import DTCheckpoint, TrainingState

if TYPE_CHECKING:
    from .training import Run


def rank_rng(run: Run) -> dict:
    """This process's random streams: torch (dropout), numpy, the batch sampler (and CUDA's)."""
    rng = {"torch": torch.get_rng_state(), "numpy": numpy_state(), "sampler": run.sampler.state_dict()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    return rng


def gather_rng(run: Run) -> list[dict]:
    """Every process's random streams, rank order (a collective: all processes call it)."""
    mine = rank_rng(run)
    if run.dist.world == 1:
        return [mine]
    out = [None] * run.dist.world
    dist.all_gather_object(out, mine)
    return out


def numpy_state() -> dict:
    """numpy's global stream as tensors and plain data (what ``torch.load(weights_only=True)`` reads)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def set_numpy_state(state) -> None:
    """Restore numpy's global stream from ``numpy_state`` (or the tuple older checkpoints hold)."""
    if isinstance(state, dict):
        keys = state["keys"].numpy() if isinstance(state["keys"], torch.Tensor) else np.asarray(state["keys"])
        state = (state["name"], keys.astype(np.uint32), state["pos"], state["has_gauss"], state["cached_gaussian"])
    np.random.set_state(state)


def checkpoint_of(run: Run, rngs: list[dict]) -> DTCheckpoint:
    return DTCheckpoint(model_config=run.model.cfg, model=run.model.state_dict(), data=run.info,
                        config=dataclasses.asdict(run.cfg),
                        training=TrainingState(optimizer=run.opt.state_dict(), scheduler=run.sched.state_dict(),
                                               rng=rngs, step=run.step, train_time=run.train_time,
                                               history=run.history))


def save(run: Run, mon: RunMonitor) -> None:
    """Write ``last.pt`` (rank 0, atomically) after putting the logged events on disk, so a resume
    purges only what came after it. A collective: every process calls it."""
    rngs = gather_rng(run)
    if run.dist.main:
        run.history = training_log.eval_history(mon)
        mon.flush()
        dt_checkpoint.save(checkpoint_of(run, rngs), run.out / dt_checkpoint.FILENAME)
    run.dist.barrier()


class WallClock:
    """Checkpoints by wall time as well as by steps (``checkpoint_minutes``): a run stopped in its
    first hour, long before its first step checkpoint, still resumes. Checkpoints are exact at any
    step, so when they come does not change what a resumed run computes.

    Saving is a collective, so under DDP the processes must agree on the step: rank 0's clock
    decides, and its decision is broadcast every ``SYNC_EVERY`` steps (one tiny collective, not one
    per step). A single process reads its clock every step and never synchronises for it."""

    SYNC_EVERY = 10

    def __init__(self, minutes: float, run: Run):
        self.seconds, self.dist, self.device = 60.0 * minutes, run.dist, run.device
        self.restart()

    def restart(self) -> None:
        """Count from now (after any checkpoint was written)."""
        self.deadline = time.monotonic() + self.seconds

    def due(self, step: int) -> bool:
        if self.seconds <= 0:
            return False
        late = time.monotonic() >= self.deadline
        if self.dist.world == 1:
            return late
        if step % self.SYNC_EVERY:
            return False
        flag = torch.tensor([float(late and self.dist.main)], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())


def restore(run: Run, ck: DTCheckpoint) -> None:
    """Continue exactly where the checkpoint stopped (per process: each rank gets its own streams).

    With another number of processes than the run that wrote it, training continues but cannot
    repeat the uninterrupted run bit for bit; the samplers are then reseeded per rank and step.
    """
    t = ck.training
    run.model.load_state_dict(ck.model)
    run.opt.load_state_dict(t.optimizer)
    run.sched.load_state_dict(t.scheduler)
    rngs, rank = t.rng, run.dist.rank
    mine = rngs[rank] if len(rngs) == run.dist.world else rngs[0]
    torch.set_rng_state(mine["torch"])
    set_numpy_state(mine["numpy"])
    if "cuda" in mine and run.device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda"], run.device)
    if len(rngs) == run.dist.world:
        run.sampler.load_state_dict(mine["sampler"])
    else:
        if run.dist.main:
            print(f"note: the checkpoint was written by {len(rngs)} process(es), this run has {run.dist.world}; "
                  "batches are reseeded, so results will differ from an uninterrupted run", flush=True)
        fresh = np.random.default_rng([run.cfg.seed, rank, t.step]).bit_generator.state
        run.sampler.load_state_dict({**mine["sampler"], "bit_generator": fresh})
    run.step, run.train_time, run.history = t.step, t.train_time, t.history
