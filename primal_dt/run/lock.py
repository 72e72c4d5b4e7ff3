"""One process at a time in a run directory (or a sweep's output).

Two processes resuming one run would both train and overwrite each other's checkpoints and logs,
and two sweeps on one output would start every grid point twice. Whoever works in a directory
holds an advisory lock (``flock``) on its ``.lock`` file; the kernel drops it when the holder exits
in any way, a SIGKILL included, so a killed run never blocks its resume. The file holds the
holder's pid, which the refusal names.

The directory may not be the user's own making (a run copied from elsewhere, a shared file system), so
its ``.lock`` is opened without following a symbolic link and written only when it is a plain file with
one name: a ``.lock`` planted as a link to another file would otherwise have that file truncated.

This module imports nothing that loads torch, so ``envs`` (which stands apart from the models) uses it
for its own work directories too.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from .errors import SetupError, writing

FILENAME = ".lock"
_held: dict[Path, int] = {}


def hold(directory: str | Path, what: str = "run directory") -> int:
    """Lock ``directory`` (created if missing) for this process until ``release``; returns the lock's
    file descriptor (a child process given it keeps the directory held while it lives). Holding it
    again is a no-op; another process's hold is a ``SetupError`` naming that process."""
    d = Path(directory).resolve()
    if d in _held:
        return _held[d]
    path = d / FILENAME
    with writing(path, f"lock file of the {what}"):
        d.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise
            fd = None
    info = os.fstat(fd) if fd is not None else os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        if fd is not None:
            os.close(fd)
        raise SetupError(_not_a_lock(path, info, what))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise SetupError(f"the {what} {d} is in use by {holder}; wait for it to end (or stop it) and try again"
                         ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[d] = fd
    return fd


def holder(directory: str | Path) -> str | None:
    """Who holds ``directory`` now, in words ("process 1234"), or None when nobody else does (this
    process's own hold counts as free). Only asks: creates nothing, holds nothing."""
    d = Path(directory).resolve()
    if d in _held:
        return None
    try:
        fd = os.open(d / FILENAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # no lock file (nobody ever held it), or one hold() would refuse with its reason
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)


def _not_a_lock(path: Path, info: os.stat_result, what: str) -> str:
    """The refusal of a ``.lock`` that is not a plain file of its own: what it is, and what to do."""
    if stat.S_ISLNK(info.st_mode):
        kind = f"a symbolic link (to {os.readlink(path)})"
    elif stat.S_ISREG(info.st_mode):
        kind = f"a file with {info.st_nlink} names (a hard link)"
    else:
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
    return (f"the lock file of the {what}, {path}, is {kind}; primal-dt writes its lock only to a plain file, so "
            f"that it never overwrites another one: remove {path} (rm) if nothing of yours needs it, and try again")


def release(directory: str | Path) -> None:
    """Give up this process's hold on ``directory`` (nothing if it holds none)."""
    fd = _held.pop(Path(directory).resolve(), None)
    if fd is not None:
        os.close(fd)


def _holder(fd: int) -> str:
    """Who holds the lock, in words: its pid, read from the file (the holder writes it just after
    locking, so an empty file is read again briefly)."""
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            break
        time.sleep(0.01)
    if not text.isdigit():
        return "another process"
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:  # the holder died, but a process it started still holds the lock
        return f"processes started by process {text} (which has exited; they are still running)"
    except PermissionError:
        pass
    return f"process {text}"
