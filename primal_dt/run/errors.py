"""How a command fails, the same way in every entry point: bad input (``SetupError``) ends as a usage
error, one ``error: ...`` line with exit status 2; a write the machine refused (``WriteError``: disk
full, no permission) and the run's own expected failures end with one line and exit status 1. Keeping
this in one place means a user meets one error style whichever command they run. It imports nothing
that loads torch, so ``envs`` can raise and report errors the same way."""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

from .cli import fail


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
        _close_process_group()


def _close_process_group() -> None:
    """Leave a DDP process group if this process joined one. Looked up among the loaded modules, not
    imported: a process that never loaded torch has no group, and this module (which ``lock`` and so
    ``envs`` import) stays free of torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
