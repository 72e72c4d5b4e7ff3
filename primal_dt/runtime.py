"""What every entry point shares, in one place: how bad input fails, the processes of a run (DDP),
the device, threads and seeds, where a resumed run lives, and the ``attention_options`` grammar.

Entry points (``primal_dt.train``, ``primal_dt.classify``) only wire: they parse their config, call
these, hand the work to a trainer, and let ``main`` turn an expected failure into one line. Keeping
these here means a user meets the same error style, the same ``resume=`` and ``device=`` rules and
the same option spelling whichever command they run.
"""

from __future__ import annotations

import datetime
import difflib
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import yaml


# -- failing on bad input --------------------------------------------------------------------------
class SetupError(ValueError):
    """Bad input found before any work starts: unknown env / task / model, bad values, a missing or
    foreign checkpoint. The user's input is at fault, not the code, so entry points print it as one
    line (``error: ...``, exit status 1) instead of a traceback that would bury the message."""


@contextmanager
def setup_errors(*also: type[Exception]):
    """Inside this block, the errors config checks, loaders and model constructors raise for bad
    input (ValueError, FileNotFoundError, and ``also``) become ``SetupError`` with the same message.
    They keep their plain types where they are raised, so library users catch what they expect."""
    try:
        yield
    except SetupError:
        raise
    except (ValueError, FileNotFoundError, *also) as err:
        raise SetupError(str(err)) from err


def main(run: Callable[[list[str]], object], argv: Sequence[str] | None = None,
         expected: tuple[type[BaseException], ...] = ()) -> None:
    """Run an entry point's ``run(argv)``; ``SetupError`` and the ``expected`` failures (e.g. a
    diverged training run) become ``error: <message>`` and exit status 1. Ctrl-C exits with 130 after
    the trainer has said how to continue; the process group is always left cleanly."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        run(argv)
    except (SetupError, *expected) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        close_distributed()


# -- processes (DDP) -------------------------------------------------------------------------------
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
        """Wait for every process (a no-op for one process)."""
        if self.world > 1:
            dist.barrier()


def init_distributed(device: str) -> Dist:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1): gloo on CPU, nccl on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not dist.is_initialized():  # ranks > 0 wait at a barrier while rank 0 evaluates: allow long evaluations
        if gpu:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(hours=2))
    return Dist(dist.get_rank(), dist.get_world_size(), local)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_replicas(model: torch.nn.Module, d: Dist) -> bool:
    """Under DDP, confirm (and print, on rank 0) that every process ends with the same parameters:
    they should, bit for bit, and a silent drift would make the saved model one replica's guess.
    A collective: every process calls it."""
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


# -- device, threads, seeds ------------------------------------------------------------------------
DEVICES = "auto | cpu | cuda | cuda:N"


def check_device(name: str, option: str = "device") -> None:
    """Reject a misspelt device before anything runs (whether CUDA exists is ``pick_device``'s call)."""
    if not (name in ("auto", "cpu") or name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit())):
        raise ValueError(f"{option} must be auto, cpu, cuda or cuda:N, got {name!r}")


def pick_device(name: str, d: Dist = Dist()) -> torch.device:
    """``auto``: CUDA when present, else CPU. ``cuda`` under DDP is this process's own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SetupError(f"device={name} but CUDA is not available; use device=cpu")
        return torch.device(f"cuda:{d.local_rank}" if name == "cuda" else name)
    return torch.device("cpu")


def set_threads(threads: int) -> None:
    """torch's CPU threads (0: torch's default). On 2 cores a second busy process makes
    multi-threaded small ops collapse, so runs that share a machine ask for 1."""
    if threads > 0:
        torch.set_num_threads(threads)


def seed_torch(seed: int) -> None:
    """Seed torch's generators (CPU and every CUDA device): weight initialisation and dropout. Each
    batch sampler owns its own numpy Generator, seeded where it is built, so a run's random
    streams are exactly these plus the samplers' (what a checkpoint saves for an exact resume)."""
    torch.manual_seed(seed)


# -- where a resumed run lives ---------------------------------------------------------------------
def resume_checkpoint(path: str, filename: str = "last.pt") -> Path:
    """``resume=PATH`` names a checkpoint file or a run directory (meaning its ``filename``); the
    resumed run continues in that file's directory. A clear error when there is none."""
    p = Path(path)
    if p.is_dir():
        p = p / filename
    if not p.is_file():
        raise SetupError(f"resume={path}: no checkpoint at {p}; give a run directory (with its {filename}) or "
                         "a checkpoint file")
    return p


# -- option grammar --------------------------------------------------------------------------------
def attention_options(text: str, option: str = "attention_options",
                      defaults: dict[str, dict] | None = None) -> dict[str, dict]:
    """Parse the command line's per-mechanism constructor options, a YAML mapping such as
    ``{softmax: {window: 30}}``. ``defaults`` ({mechanism: {option: value}}) fill what the text
    leaves out: options that have their own flags (``model.s``, ``primal.s``) reach the mechanism
    this way, and an explicit entry in the text still wins. ``option`` names the flag in errors."""
    from .attention import available

    try:
        opts = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as err:
        raise ValueError(f"{option} is not valid YAML ({' '.join(str(err).split())}); write e.g. "
                         f"{option}=\"{{softmax: {{window: 30}}}}\"") from err
    if not isinstance(opts, dict) or not all(isinstance(v, dict) for v in opts.values()):
        raise ValueError(f"{option} must be a YAML mapping of mechanism -> options, got {text!r}")
    known = available()
    for name in opts:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"{option}: unknown attention mechanism {name!r}.{hint} Known: {', '.join(known)}")
    for name, values in (defaults or {}).items():
        opts[name] = {**values, **opts.get(name, {})}
    return opts
