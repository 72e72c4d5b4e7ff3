"""How every entry point fails: bad input (``SetupError``) is one ``error: ...`` line with exit status 2; a
refused write (``WriteError``) and a run's expected failures, one line with status 1; a path the file system cannot
use as given (a name over 255 bytes, a loop of links), wherever it is opened, one line naming the option or
environment variable that gave it, status 2. No torch here."""

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


_PATH_MISTAKES = {errno.ENAMETOOLONG: "a name in it is longer than the file system allows (255 bytes a name, 4096 a "
                                     "path); give a shorter path",
                  errno.ELOOP: "it loops through symbolic links (a link that leads back to itself); fix or remove "
                               "the link"}
"""errors of a path as it is written, whatever opened it: the user's input at fault, not the machine"""
ENVIRONMENT = ("MINARI_DATASETS_PATH", "D4RL_DATASET_DIR", "PRIMAL_DT_DATA_DIR", "PRIMAL_DT_BEHAVIOR_DIR",
               "XDG_CACHE_HOME", "HOME")
"""environment variables the package builds paths from, named when their value is the path at fault"""
_RESOLVE_LOOP = "Symlink loop from "


def path_mistake(err: BaseException, argv: Sequence[str], environ=os.environ) -> str | None:
    """The one line for ``err`` when it (or the OSError a ``WriteError`` wraps) is ``_PATH_MISTAKES``' (None for
    any other error): what is wrong with which path, naming the option (``key=value``, ``--key value``, an
    argument) or environment variable it came from, so no path option needs a check of its own."""
    cause = err
    while isinstance(cause, WriteError) and cause.__cause__ is not None:  # a WriteError said again with more words
        cause = cause.__cause__
    if isinstance(cause, RuntimeError) and str(cause).startswith(_RESOLVE_LOOP):  # Path.resolve's, before 3.13
        code, path = errno.ELOOP, str(cause)[len(_RESOLVE_LOOP):].strip("'\"")
    elif isinstance(cause, OSError) and cause.errno in _PATH_MISTAKES:
        code, path = cause.errno, str(cause.filename or "")
    else:
        return None
    at_fault = name_too_long if code == errno.ENAMETOOLONG else lambda value: _on_path(value, path)
    given = [(f"{word.split('=', 1)[0]}=", word.split("=", 1)[1]) if "=" in word else
             (f"{argv[i - 1]} ", word) if i and argv[i - 1].startswith("-") else ("the argument ", word)
             for i, word in enumerate(argv) if not word.startswith("-") or "=" in word]
    given += [(f"{name}=", environ[name]) for name in ENVIRONMENT if environ.get(name)]
    name, value = next(((name, value) for name, value in given if value and at_fault(value)),
                       ("the path ", path) if path else ("a path", ""))
    return path_line(name, value, code)


def _on_path(value: str, path: str) -> bool:
    """Whether the path ``value`` (or the one in it, as in ``d4rl:PATH``) leads to or through ``path``, or
    ``path`` through it."""
    if not path:
        return False
    at = os.path.abspath(path)
    for v in {value, value.split(":", 1)[-1]}:
        v = os.path.abspath(v)
        if v == at or v.startswith(at.rstrip("/") + "/") or at.startswith(v.rstrip("/") + "/"):
            return True
    return False


def path_line(name: str, value: str, code: int) -> str:
    """``<name><value>: what is wrong`` for a ``_PATH_MISTAKES`` errno ``code`` (``name``: ``out=``, ``--json ``)."""
    return f"{name}{_short(value)}: {_PATH_MISTAKES[code]}"


def name_too_long(value: str) -> bool:
    """Whether the path ``value`` (or the path in it, as in ``d4rl:PATH``) has a name or a length Linux refuses."""
    parts = os.fsencode(value).split(b"/")
    return len(os.fsencode(value)) >= 4096 or any(len(part) > 255 for part in parts)


def _short(text: str) -> str:
    """``text``, its middle elided past 200 characters (a 300-byte name would fill the error line)."""
    return text if len(text) <= 200 else f"{text[:60]}...({len(text)} characters)...{text[-40:]}"


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
        if (line := path_mistake(err, argv)) is not None:
            fail(line)
        sys.exit(f"error: {err}")
    except (OSError, RuntimeError) as err:
        if (line := path_mistake(err, argv)) is None:
            raise
        fail(line)
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
