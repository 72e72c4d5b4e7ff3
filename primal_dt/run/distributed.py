"""The processes of a run launched by torchrun (DistributedDataParallel): each process's place, joining
and leaving the process group, and the end-of-run check that every replica holds the same weights."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import SetupError


@dataclass(frozen=True)
class Dist:
    """This process's place among a run's processes; a plain run is rank 0 of 1."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the process that evaluates and writes files."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def init_distributed(device: str) -> Dist:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1): gloo on CPU, nccl on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if gpu and not torch.cuda.is_available():  # before NCCL would fail with its own traceback
        raise SetupError(f"device={device} but CUDA is not available; use device=cpu (DDP over gloo)")
    if not dist.is_initialized():  # ranks > 0 wait at a barrier while rank 0 evaluates: allow long evaluations
        if gpu:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(hours=2))
    return Dist(dist.get_rank(), dist.get_world_size(), local)


def check_replicas(model: torch.nn.Module, d: Dist) -> bool:
    """Under DDP, whether (printed on rank 0) every process ends with bit-identical parameters. A collective."""
    if d.world <= 1:
        return True
    flat = torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])
    sums = torch.stack([flat.sum(), (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum()])
    if dist.get_backend() == "nccl":
        sums = sums.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = [torch.zeros_like(sums) for _ in range(d.world)]
    dist.all_gather(gathered, sums)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    if d.main:
        print(f"DDP: parameters {'identical' if same else 'DIFFERENT'} on {d.world} processes", flush=True)
    return same
