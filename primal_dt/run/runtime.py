"""Where a run computes, the same for every entry point: the device, torch's CPU threads, the seeds."""

from __future__ import annotations

import os

import torch

from .distributed import Dist
from .errors import SetupError
from .options import check_device


def pick_device(name: str, d: Dist = Dist(), option: str = "device") -> torch.device:
    """``auto``: CUDA when present, else CPU; ``cuda`` under DDP: this process's own GPU; else a ``SetupError``."""
    try:
        check_device(str(name), option)
    except ValueError as err:
        raise SetupError(str(err)) from None
    name = str(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not name.startswith("cuda"):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise SetupError(f"{option}={name} but CUDA is not available; use {option}=cpu or {option}=auto ({why}, "
                         f"torch {torch.__version__})")
    device = torch.device(f"cuda:{d.local_rank}" if name == "cuda" else name)
    count = torch.cuda.device_count()
    if device.index >= count:
        which = f"process {d.local_rank} of this machine's DDP processes needs" if name == "cuda" else "asks for"
        raise SetupError(f"{option}={name}: {which} cuda:{device.index}, but this machine has {count} CUDA "
                         f"device(s) (cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); use one of them, "
                         f"or {option}=cuda")
    return device


def native_bf16(device: str) -> bool:
    """What ``amp=auto`` resolves to bf16 on: a run on the CPU (``device`` cpu, or auto without CUDA) of a CPU
    that computes bfloat16 natively (AVX512-BF16 or AMX), where the CPU recipe's step took half the time and its
    scores held (docs/cpu.md). Elsewhere float32: emulated bf16 is slower, and on a GPU primal+dt did not train in
    it (docs/results/gpu-h200-recipe-bf16.md)."""
    if str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return False
    return any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


SMALL_CPU = 4
"""usable cores up to which ``threads=0`` means one torch thread per process"""


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: taskset, a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def set_threads(threads: int, d: Dist = Dist()) -> int:
    """Set torch's CPU threads: ``threads``, or for 0 one per process on a small CPU (where a second busy
    process makes multi-threaded small operations collapse), else the process's share of the cores."""
    if threads <= 0:
        cores = usable_cores()
        world = int(os.environ.get("LOCAL_WORLD_SIZE", d.world))
        threads = 1 if cores <= SMALL_CPU else max(1, cores // max(1, world))
    torch.set_num_threads(threads)
    return threads


def seed_torch(seed: int) -> None:
    """Seed torch's generators (CPU and CUDA): initialisation and dropout (samplers own their generators)."""
    torch.manual_seed(seed)
