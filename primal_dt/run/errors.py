"""How every entry point fails: bad input (``SetupError``) is one ``error: ...`` line with exit status 2; a
refused write (``WriteError``) and a run's expected failures, one line with status 1. No torch here."""

from __future__ import annotations

import difflib
import errno
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

from .cli import fail


class SetupError(ValueError):
    """Bad input found before any work: the input is at fault, not the code, so no traceback."""


@contextmanager
def setup_errors(*also: type[Exception]):
    """Inside this block, what checks and loaders raise (ValueError, FileNotFoundError, ``also``) is a SetupError."""
    try:
        yield
    except SetupError:
        raise
    except (ValueError, FileNotFoundError, *also) as err:
        raise SetupError(str(err)) from err


class WriteError(OSError):
    """A write the machine refused (disk full, ``ulimit -f``, no permission): one line naming the file."""


_WHY = {errno.ENOSPC: "no space left on the device (disk full)", errno.EDQUOT: "disk quota exceeded",
        errno.EFBIG: "file too large (a file-size limit such as `ulimit -f` was reached)",
        errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
        errno.EROFS: "read-only file system", errno.ENOTDIR: "a part of the path is a file, not a directory",
        errno.EEXIST: "a file is in the way of a directory", errno.EISDIR: "a directory is in the way"}


def did_you_mean(word: str, choices, n: int = 3, cutoff: float = 0.6) -> str:
    """`` Did you mean 'a', 'b'?`` with the ``choices`` closest to ``word``, or "" when none is close."""
    close = difflib.get_close_matches(word, choices, n=n, cutoff=cutoff)
    return f" Did you mean {', '.join(map(repr, close))}?" if close else ""


def why(err: OSError) -> str:
    return _WHY.get(err.errno, err.strerror or str(err))


@contextmanager
def writing(path: str | Path, what: str):
    """Inside this block, an OSError is a ``WriteError`` naming ``path``, ``what`` and why (callers: what survives)."""
    try:
        yield
    except WriteError:
        raise
    except OSError as err:
        raise WriteError(f"could not write the {what} {path}: {why(err)}") from err


def main(run: Callable[[list[str]], object], argv: Sequence[str] | None = None,
         expected: tuple[type[BaseException], ...] = ()):
    """Run an entry point's ``run(argv)``; failures as the module says (``expected``: e.g. a diverged run),
    Ctrl-C with status 130; a DDP process group is always left."""
    argv = sys.argv[1:] if argv is None else list(argv)
    finished = False
    try:
        result = run(argv)
        finished = True
        return result
    except SetupError as err:
        fail(str(err))
    except (WriteError, *expected) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        sys.exit(130)
    finally:  # leave a DDP process group if this process joined one (looked up, not imported: no torch here)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            leaving = sys.exc_info()[1]  # a bug's traceback still goes through the interpreter
            if finished or isinstance(leaving, SystemExit):
                _exit_without_finalizing(None if finished else leaving.code)


def _exit_without_finalizing(code: int | str | None) -> None:
    """End a DDP process whose work is written with ``sys.exit``'s status (a text: printed, status 1), skipping
    the interpreter's finalization. Why: gloo's worker threads release the last collective's tensors after it
    completes; on a loaded machine that can fall in the finalization, where taking the interpreter's lock ends
    the thread mid-way and ``std::terminate`` aborts the process (status -6, torchrun reporting a run that
    succeeded as failed, or a failed one as crashed)."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else int(code is not None))
