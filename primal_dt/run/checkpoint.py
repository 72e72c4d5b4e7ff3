"""Checkpoint files (a dict of tensors and plain data laid out by its trainer). Three promises:
- **Atomic**: every file the package writes goes to a temporary beside it, renamed over the old one: a crash,
  a kill or a full disk leaves the previous file; a failed write is one ``errors.WriteError``.
- **No code runs on load**: ``torch.load(weights_only=True)``; a pickle naming anything else is refused.
- **No stale temporaries**: the writer holds a ``flock`` on its temporary (dropped by the kernel however it
  ends); ``remove_stale_temps`` deletes those whose lock it can take.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import os
import pickle
import re
import stat
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from . import errors, lock


def save_atomic(obj, path: str | Path, what: str = "checkpoint") -> Path:
    """``write_atomic`` of ``obj`` serialised in memory first (a failed write: the file's, not torch's, error)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return write_atomic(path, buf.getbuffer(), what)


def sha256_file(path: str | Path) -> str:
    """The file's SHA-256: what names a checkpoint wherever it is copied or moved."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: str | Path, data: bytes | str, what: str, *, replace: bool = True) -> Path:
    """Write ``data`` to ``path`` through a temporary renamed over it (a replaced file keeps its mode, a new one
    gets the umask's); a failure is one ``WriteError``. ``replace=False``: the temporary is linked to ``path``,
    so an existing file is a ``FileExistsError`` (of two writers only one succeeds)."""
    path = Path(path)
    exists = False
    with errors.writing(path, what):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _locked_temp(path)
        try:
            os.fchmod(fd, _mode(path))
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
                if replace:
                    os.replace(tmp, path)  # still locked: no cleaner takes a temporary being renamed
                else:
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        exists = True
                    os.unlink(tmp)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    if exists:
        raise FileExistsError(errno.EEXIST, f"{path} exists", str(path))
    return path


def _locked_temp(path: Path) -> tuple[int, str]:
    """A new temporary beside ``path``, open and locked (made again if a cleaner took it before the lock)."""
    while True:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        fcntl.flock(fd, fcntl.LOCK_EX)
        with suppress(FileNotFoundError):
            if os.lstat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp
        os.close(fd)


def _mode(path: Path) -> int:
    """An existing file's permissions, else what a new file gets: ``0o666`` less the umask, read from /proc
    (``os.umask`` reads it only by changing it: a race with threads). A symlink is replaced like a missing file:
    its target's permissions belong to whatever it points at, perhaps a file planted world-writable."""
    with suppress(OSError):
        info = os.lstat(path)
        if not stat.S_ISLNK(info.st_mode):
            return stat.S_IMODE(info.st_mode)
    with suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


_TEMP = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp$")  # tempfile.mkstemp's names


def remove_stale_temps(*directories: str | Path, names: tuple[str, ...] | None = None) -> list[Path]:
    """Delete the temporaries of interrupted writes in ``directories`` (of the files ``names`` only, if given)
    whose lock can be taken, so a live writer's is never touched; says so on stderr, returns them."""
    removed = []
    for d in directories:
        for p in Path(d).glob(".*.tmp"):  # none in what is not a directory
            m = _TEMP.match(p.name)
            if not m or (names is not None and m["name"] not in names):
                continue
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue  # gone already (another cleaner, a finished rename), or not a file of ours
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if stat.S_ISREG(os.fstat(fd).st_mode) and os.lstat(p).st_ino == os.fstat(fd).st_ino:
                    p.unlink()
                    removed.append(p)
            except (BlockingIOError, FileNotFoundError):
                pass  # a live writer holds it, or it was renamed or removed meanwhile
            finally:
                os.close(fd)
    if removed:
        print(f"removed {len(removed)} temporary file(s) of interrupted writes: {', '.join(map(str, removed))}",
              file=sys.stderr, flush=True)
    return removed


def find(path: str | Path, filename: str, option: str) -> Path:
    """The checkpoint ``option=path`` means: a file; a run directory's ``filename``; or the most recently
    written ``filename`` under a directory of runs (said on stderr). Else a ``FileNotFoundError``."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"{option}={path}: no checkpoint at {p}; it does not exist: give a run directory (with "
                                f"its {filename}), a directory of runs, or a checkpoint file")
    if (p / filename).is_file():
        return p / filename
    found = [f for f in p.rglob(filename) if f.is_file()]
    if not found:
        raise FileNotFoundError(f"{option}={path}: no checkpoint at {p / filename}, nor in any run under it; give "
                                f"a run directory (with its {filename}), a directory of runs, or a checkpoint file (a "
                                "run writes its first checkpoint after its first minute or checkpoint_every steps)")
    newest = max(found, key=lambda f: (f.stat().st_mtime, str(f)))
    print(f"{option}={path}: using the newest run with a {filename} under it, {newest.parent}", file=sys.stderr,
          flush=True)
    return newest


@contextmanager
def run_directory(out: Path, resumed: bool, kept: Callable[[], str], command: str, main: bool = True):
    """Hold ``out`` (on rank 0, ``main``) for the run inside, its stale temporaries removed (a new run's: those of
    the runs beside it); a failed write says what survived (``kept()``) and how to continue."""
    if main:
        lock.hold(out)  # one process per run: a second resume is refused, naming the first
        remove_stale_temps(*([out] if resumed else out.parent.iterdir()))
    try:
        yield
    except errors.WriteError as err:
        raise errors.WriteError(f"{err}. Nothing else was lost: {kept()}; make room (or fix the permissions) and "
                                f"continue with: python -m {command} resume={out}") from err
    finally:
        lock.release(out)


UNFIT = (KeyError, TypeError, ValueError, RuntimeError, IndexError, OverflowError)
"""what loading a training state into a model and optimizer raises when it does not fit them"""


def unfit(where: str, err: Exception) -> errors.SetupError:
    """The error for a checkpoint whose parts passed their checks but do not fit the run they describe."""
    return errors.SetupError(f"{where}: its training state does not fit the run it describes ({type(err).__name__}: "
                             f"{str(err).splitlines()[0][:200]}); the file is damaged: resume from another "
                             "checkpoint or start a new run")


WEIGHT_LIMIT = 1e6
"""the largest weight a checkpoint may hold: AdamW moves a weight by a few ``lr`` per step at most, so training
never comes near it, while a weight near float32's limit (3.4e38) makes a first matmul overflow to inf"""


def check_state_dict(state, expected: Mapping[str, torch.Tensor], where: str, field: str = "model",
                     reach: float | None = None) -> None:
    """Refuse a state_dict (``field`` of the checkpoint ``where``) that is not, tensor for tensor, what the
    network it describes keeps: ``expected`` is that network's own ``state_dict()``, built on the meta device, so
    names, dtypes and shapes are known without allocating anything. Each tensor's storage must hold its elements
    (a 2-element storage viewed with stride 0 as a 10^12-row matrix loads in microseconds and makes the first
    reader that touches it ask for terabytes); only then are its values read: finite and at most
    ``WEIGHT_LIMIT`` in size (a 1e38 weight is finite, yet every action it computes is inf). Any field holding
    a state_dict (the weights, an average of them) is checked here, naming ``field``. ``reach``: how far the
    file's own training could have moved a weight (its learning rates and steps), if it records one: weights
    beyond the limit but within it are a run that diverged (an absurd lr), refused as such, not as damage."""
    if not (isinstance(state, dict) and all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                            for k, t in state.items())):
        shown = f"a {type(state).__name__}" if not isinstance(state, dict) else "a dict holding other things"
        raise ValueError(f"{where}: {field} must be a state_dict (parameter name -> tensor), got {shown}; the file is "
                         "damaged: use another checkpoint")
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = ([f"lacks weight{'s' * (len(missing) > 1)} {_few(missing)}"] if missing else []) + (
            [f"holds weight{'s' * (len(unexpected) > 1)} {_few(unexpected)} that its network has not"]
            if unexpected else [])
        raise ValueError(f"{where}: its weights do not fit its model_config: {field} {' and '.join(parts)}; the file "
                         "is damaged or was altered: use another checkpoint")
    for name, want in expected.items():
        t = state[name]
        if t.layout != torch.strided or t.dtype != want.dtype:
            got = t.dtype if t.layout == torch.strided else t.layout
            raise ValueError(f"{where}: weight {name} ({field}) is {got}, but its network keeps {want.dtype}; the "
                             "file is damaged or was altered (its actions would change): use another checkpoint")
        if t.shape != want.shape:
            raise ValueError(f"{where}: its weights do not fit its model_config: the file holds weight {name} "
                             f"({field}) of shape {tuple(t.shape)}, its model_config makes {tuple(want.shape)}; "
                             "the file is damaged or was altered: use another checkpoint")
        if not holds_its_elements(t):
            raise ValueError(f"{where}: weight {name} ({field}) of shape {tuple(t.shape)} is a view of "
                             f"{t.untyped_storage().nbytes()} bytes of storage repeating its values, which no "
                             "torch.save of a network writes; the file was crafted: delete it")
    for name, t in state.items():  # the shapes are the network's own now: reading the values is bounded
        if t.is_floating_point() and not bool((t.abs() <= WEIGHT_LIMIT).all()):
            if not bool(torch.isfinite(t).all()):  # training never takes a step that diverged
                raise ValueError(f"{where}: weight {name} holds NaN or inf values ({field}), which training never "
                                 "saves; the file is damaged: use another checkpoint")
            size = float(t.abs().max())
            if reach is not None and size <= WEIGHT_LIMIT + reach:
                raise ValueError(f"{where}: weight {name} ({field}) holds values up to {size:.3g} in size, beyond "
                                 f"{WEIGHT_LIMIT:g}, where no policy acts (its actions overflow): its run's own "
                                 f"learning rate moved them there (it allows {reach:.3g} over the steps taken), so the "
                                 "run diverged by this checkpoint; train again with a lower lr (or grad_clip > 0)")
            raise ValueError(f"{where}: weight {name} ({field}) holds values up to {size:.3g} in size, "
                             f"beyond {WEIGHT_LIMIT:g}, which training never reaches (its actions would overflow); "
                             "the file is damaged or was altered: use another checkpoint")


def holds_its_elements(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds as many bytes as its elements: a view repeating a few values (stride 0) does
    not, and anything computed from it is allocated at its full, perhaps impossible, size."""
    return t.layout == torch.strided and t.untyped_storage().nbytes() >= t.numel() * t.element_size()


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")


def load(path: str | Path, expect_kind: str | None = None, keys: tuple[str, ...] = ("model", "config")) -> dict:
    """A checkpoint (a dict with ``keys``) read without running code; a bad file is one clear error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    _check_format(path)
    try:  # torch warns about a foreign pickle before refusing it: only the refusal below should print
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"checkpoint {path} was not loaded: {_refusal(path, err)}") from err
    except OSError as err:
        raise ValueError(f"checkpoint {path} cannot be read: {errors.why(err)}") from err
    except Exception as err:  # torch raises many kinds for a corrupt file
        raise ValueError(f"checkpoint {path} could not be read ({type(err).__name__}: {err}); "
                         "it may be truncated or not a primal-dt checkpoint") from err
    if not isinstance(ckpt, dict) or not any(k in ckpt for k in (*keys, "kind")):
        raise ValueError(f"{path} is not a primal-dt checkpoint (expected a dict with {' and '.join(map(repr, keys))})")
    if lacks := [k for k in keys if k not in ckpt]:  # the rest is a checkpoint's: this file lost a part
        raise ValueError(f"checkpoint {path} lacks {' and '.join(map(repr, lacks))}: the file is damaged or was "
                         "altered: use another checkpoint")
    if expect_kind is not None and ckpt.get("kind") != expect_kind:
        raise ValueError(f"checkpoint {path} holds a {ckpt.get('kind')!r} model, expected {expect_kind!r}")
    return ckpt


# what a file that is not torch.save's (a zip archive, or a pickle in the legacy format) most likely is
_OTHER_FORMATS = {b"\x89HDF": "an HDF5 file (a dataset? give it as data_source=d4rl:PATH)", b"{": "a JSON file",
                  b"[": "a JSON file", b"\x08": "an ONNX graph or another protobuf (load it with agents.onnx_policy)"}


def _check_format(path: Path) -> None:
    """A file that is no torch checkpoint at all is named for what it is, not refused as a foreign pickle."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return  # torch.load says why below
    if head.startswith((b"PK\x03\x04", b"\x80")) or not head:
        return
    what = next((f"is {w}, not a PyTorch checkpoint" for magic, w in _OTHER_FORMATS.items() if head.startswith(magic)),
                f"is not a PyTorch checkpoint (torch.save writes a zip archive; this file begins {head!r})")
    raise ValueError(f"checkpoint {path} {what}; give a run directory or the last.pt that training wrote")


def _refusal(path: Path, err: Exception) -> str:
    """Why a file was refused: the objects it would have built (read statically), and what to do."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip checkpoint at all: say what the unpickler said
        names = []
    # the unpickler's own words when the static scan found nothing (an object it was asked to build)
    names = names or re.findall(r"(?:GLOBAL |got <class ')([^'\s]+)", str(err))
    what = ", ".join(names) if names else "objects of unknown type"
    return (f"it holds pickled objects other than tensors and plain data ({what}), which could run code "
            "when loaded. primal-dt never writes such files. If you made this file yourself and trust it, load it "
            "with torch.load(path, weights_only=False) and save only its tensors and plain data; otherwise delete it")
