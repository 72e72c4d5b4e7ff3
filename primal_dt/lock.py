"""One process at a time in a run directory (or a sweep's output).

Two processes resuming one run would both train and overwrite each other's checkpoints and logs,
and two sweeps on one output would start every grid point twice. Whoever works in a directory
holds an advisory lock (``flock``) on its ``.lock`` file; the kernel drops it when the holder exits
in any way, a SIGKILL included, so a killed run never blocks its resume. The file holds the
holder's pid, which the refusal names.
"""

from __future__ import annotations

import fcntl
import os
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
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
