"""What every entry point shares, in one place: how bad input fails (and how a full disk does), the
checks every numeric option passes, the processes of a run (DDP), the device, threads and seeds,
where a resumed run lives, how a new output claims a name no other run holds, and the
``attention_options`` grammar.

Entry points (``primal_dt.train``, ``primal_dt.classify``) only wire: they parse their config, call
these, hand the work to a trainer, and let ``main`` turn an expected failure into one line. Keeping
these here means a user meets the same error style, the same ``resume=`` and ``device=`` rules and
the same option spelling whichever command they run.
"""

from __future__ import annotations

import datetime
import difflib
import errno
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from .cli import fail


# -- failing on bad input --------------------------------------------------------------------------
class SetupError(ValueError):
    """Bad input found before any work starts: unknown env / task / model, bad values, a missing or
    foreign checkpoint. The user's input is at fault, not the code, so entry points end as for a mistake
    tyro finds (``cli.fail``: one ``error: ...`` line, exit status 2), not with a traceback that would
    bury the message."""


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


class WriteError(OSError):
    """Something a command had to write could not be written: the disk is full, a file-size limit
    (``ulimit -f``) was reached, the directory is not writable, the file system is read-only. The
    machine is at fault, not the code, so entry points print the message (which names the file and
    what was not written) as one ``error:`` line instead of the writer's internal traceback."""


_WHY = {errno.ENOSPC: "no space left on the device (disk full)", errno.EDQUOT: "disk quota exceeded",
        errno.EFBIG: "file too large (a file-size limit such as `ulimit -f` was reached)",
        errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
        errno.EROFS: "read-only file system", errno.ENOTDIR: "a part of the path is a file, not a directory",
        errno.EEXIST: "a file is in the way of a directory", errno.EISDIR: "a directory is in the way"}


def why(err: OSError) -> str:
    """A failed write's cause in words (errno's name for the common ones, else the system's message)."""
    return _WHY.get(err.errno, err.strerror or str(err))


@contextmanager
def writing(path: str | Path, what: str):
    """Inside this block, an ``OSError`` from writing ``path`` becomes ``WriteError`` saying which
    file, what it should have held (``what``: "checkpoint at step 40", "run directory", ...) and
    why it could not; callers add what survives (e.g. the previous checkpoint)."""
    try:
        yield
    except WriteError:
        raise
    except OSError as err:
        raise WriteError(f"could not write the {what} {path}: {why(err)}") from err


def main(run: Callable[[list[str]], object], argv: Sequence[str] | None = None,
         expected: tuple[type[BaseException], ...] = ()):
    """Run an entry point's ``run(argv)`` and return what it returns. A ``SetupError`` (bad input) ends
    as ``cli.fail``; ``WriteError`` and the ``expected`` failures (e.g. a diverged training run) are
    failures of the run, not of its input: ``error: <message>`` and exit status 1. Ctrl-C exits with
    130 after the trainer has said how to continue; the process group is always left cleanly."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run(argv)
    except SetupError as err:
        fail(str(err))
    except (WriteError, *expected) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        close_distributed()


# -- numeric options -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """What a numeric option accepts: finite numbers (never NaN or inf) between ``low`` and ``high``,
    each bound included unless ``*_open``. Entry points declare one per option, next to their config,
    and ``check_numbers`` applies them all before any work starts."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, x: float) -> bool:
        if not math.isfinite(x):
            return False
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return False
        return self.high is None or (x < self.high if self.high_open else x <= self.high)

    def __str__(self) -> str:
        lo, hi = (None if x is None else (str(int(x)) if float(x).is_integer() else f"{x:g}")
                  for x in (self.low, self.high))
        if lo is not None and hi is not None:
            return f"in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        if lo is not None:
            return f"{'>' if self.low_open else '>='} {lo}"
        if hi is not None:
            return f"{'<' if self.high_open else '<='} {hi}"
        return "finite"


ANY = Range()
AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
POSITIVE = Range(0, low_open=True)
FRACTION = Range(0, 1, high_open=True)
"""in [0, 1): dropout, a validation share"""
SEED = Range(0, 2**32, high_open=True)
"""what every seeded generator (torch, numpy, Gymnasium's reset) accepts"""
THREADS = Range(0, 4096)
"""torch CPU threads (0: ``set_threads`` chooses); torch overflows far above any machine's core count"""


def check_number(option: str, value, rule: Range) -> None:
    """Raise ValueError ``"<option> must be <rule>, got <value>"`` unless ``value`` is a number (or,
    for a tuple option, numbers) within ``rule``; NaN and inf are outside every rule, None (an unset
    optional option) passes."""
    if value is None:
        return
    values = value if isinstance(value, (tuple, list)) else (value,)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and rule.holds(float(v)) for v in values):
        return
    if isinstance(value, (tuple, list)):
        raise ValueError(f"{option} must hold numbers that are {rule}, got {', '.join(map(str, values))}")
    raise ValueError(f"{option} must be {rule}, got {value!r}" if rule != ANY
                     else f"{option} must be a finite number, got {value!r}")


def check_numbers(cfg, rules: Mapping[str, Range], prefix: str = "") -> None:
    """``check_number`` for each option of ``cfg`` (a config dataclass; dotted names
    reach nested configs) named in ``rules``, in order. ``prefix`` is where ``cfg`` sits in its
    command line ("data.")."""
    for name, rule in rules.items():
        value = cfg
        for part in name.split("."):
            value = getattr(value, part)
        check_number(prefix + name, value, rule)


MAX_VALUES = 2**33
"""about 34 GB of float32: more weights (or activations of one step) than that is a typo, not a model"""


def check_size(values: float, options: str, what: str = "parameters") -> None:
    """Refuse sizes no machine can build (d_model=10**9 would otherwise hang in allocation or fail
    with the allocator's traceback). ``values``: how many float32 numbers the options ask for (``what``
    they are); ``options`` names the options that set them, with their values."""
    if values > MAX_VALUES:
        raise ValueError(f"{options} need about {values:.3g} {what} ({4 * values / 2**30:.3g} GB of float32), more "
                         f"than the {MAX_VALUES:.3g} this accepts; lower them")


def check_parsed(args, rules: Mapping[str, Range]) -> None:
    """``check_number`` for the options of a benchmark's command line (``rules`` keyed by flag, as the
    user writes it: ``--batch``, ``--K``); a bad value ends as ``cli.fail``. List options
    (``--lengths 256 1024``) are checked element-wise."""
    try:
        for flag, rule in rules.items():
            check_number(flag, getattr(args, flag.lstrip("-").replace("-", "_")), rule)
    except ValueError as err:
        fail(str(err))


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


# -- where a resumed run lives ---------------------------------------------------------------------
def resume_checkpoint(path: str, filename: str = "last.pt") -> Path:
    """``resume=PATH`` names a checkpoint file, a run directory (meaning its ``filename``) or a directory
    of runs (meaning the newest run holding one: ``checkpoint.find``); the resumed run continues in
    that file's directory. A clear error when there is none."""
    from .checkpoint import find

    try:
        return find(path, filename, "resume")
    except FileNotFoundError as err:
        raise SetupError(str(err)) from err


# -- claiming a new output ------------------------------------------------------------------------
def new_path(candidates: Iterable[Path], create: Callable[[Path], None], what: str = "output") -> Path:
    """The first of ``candidates`` that ``create`` makes, exclusively (``what`` names it in errors).

    ``create`` must fail with ``FileExistsError`` when the path exists (``Path.mkdir()``,
    ``create_file``): checking first and creating later lets two runs started in the same second
    pick the same name, and one would overwrite the other's files. Other failures (no permission,
    disk full) become ``WriteError``."""
    for path in candidates:
        with writing(path, what):
            try:
                create(path)
            except FileExistsError:
                continue
        return path
    raise ValueError("no candidate path left")


def check_writable(directory: Path, what: str) -> None:
    """A ``WriteError`` now, rather than after an hour of training, when files cannot be created in
    ``directory`` (a resumed run's directory made read-only, or owned by another user)."""
    import tempfile

    with writing(directory, what):
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-probe-")
        os.close(fd)
        os.unlink(probe)


def numbered(path: Path) -> Iterator[Path]:
    """``path``, then ``<stem>-2<suffix>``, ``<stem>-3<suffix>``, ... (candidates for ``new_path``)."""
    yield path
    for i in itertools.count(2):
        yield path.with_name(f"{path.stem}-{i}{path.suffix}")


def create_file(path: Path) -> None:
    """Create ``path`` empty, failing with ``FileExistsError`` if it exists (for ``new_path``)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as err:  # a file where the directory should be: not "the name is taken"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent)) from err
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))


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
