"""Where a run computes, the same for every entry point: the device, torch's CPU threads, the seeds."""

from __future__ import annotations

import os

import torch

from .distributed import Dist
from .errors import SetupError



def pick_device(name: str, d: Dist = Dist()) -> torch.device:
    """``auto``: CUDA when present, else CPU. ``cuda`` under DDP is this process's own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SetupError(f"device={name} but CUDA is not available; use device=cpu")
        return torch.device(f"cuda:{d.local_rank}" if name == "cuda" else name)
    return torch.device("cpu")


SMALL_CPU = 4
"""usable cores up to which ``threads=0`` means one torch thread per process"""


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under taskset or a container's cpuset),
    not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def set_threads(threads: int, d: Dist = Dist()) -> int:
    """Set torch's CPU threads and return them: ``threads``, or for 0 (the default) one per process
    on a small CPU (at most ``SMALL_CPU`` usable cores), where a second busy process (a simulator,
    another run) makes multi-threaded small operations collapse, and elsewhere the process's share
    of the cores (divided among the processes of a DDP run on this machine)."""
    if threads <= 0:
        cores = usable_cores()
        threads = 1 if cores <= SMALL_CPU else max(1, cores // max(1, _local_world(d)))
    torch.set_num_threads(threads)
    return threads


def _local_world(d: Dist) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", d.world))


def seed_torch(seed: int) -> None:
    """Seed torch's generators (CPU and every CUDA device): weight initialisation and dropout. Each
    batch sampler owns its own numpy Generator, seeded where it is built, so a run's random
    streams are exactly these plus the samplers' (what a checkpoint saves for an exact resume)."""
    torch.manual_seed(seed)
