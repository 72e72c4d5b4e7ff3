"""One process at a time in a run directory (or a sweep's output): two resuming one run would overwrite each
other's checkpoints. The holder takes a ``flock`` on ``.lock`` (dropped by the kernel however it ends) and
writes its pid there, for the refusal. ``.lock`` is opened without following a link and written only when it
is a plain file with one name (a planted link's target would be truncated). ``release`` removes it, so a finished
run leaves none behind: it is unlinked while still locked, and a holder whose file was unlinked after it opened it
takes the new one, so no two processes ever hold one directory through two files. Imports no torch (``envs`` uses
it).
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
    """Lock ``directory`` (created if missing) until ``release``; returns the lock's descriptor. Holding
    it again is a no-op; another process's hold is a ``SetupError`` naming it."""
    d = Path(directory).resolve()
    if d in _held:
        return _held[d]
    path = d / FILENAME
    for _ in range(100):  # a new file each time the holder before us removed the one we locked
        fd = _lock(d, path, what)
        if _names(fd, path):
            break
        os.close(fd)
    else:
        raise SetupError(f"the lock file of the {what}, {path}, kept being replaced while it was taken; try again")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[d] = fd
    return fd


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (not removed, nor replaced, since it was opened)."""
    try:
        now, ours = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino)


def _lock(d: Path, path: Path, what: str) -> int:
    """``path`` opened and flocked: a plain file with one name, or a ``SetupError`` saying what it is instead or
    who holds it."""
    with writing(path, f"lock file of the {what}"):
        d.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise
            fd = None
    info = os.fstat(fd) if fd is not None else os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:  # 0: its holder removed it just now (hold retries)
        if fd is not None:
            os.close(fd)
        kind = (f"a symbolic link (to {os.readlink(path)})" if stat.S_ISLNK(info.st_mode) else
                f"a file with {info.st_nlink} names (a hard link)" if stat.S_ISREG(info.st_mode) else
                "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file")
        raise SetupError(f"the lock file of the {what}, {path}, is {kind}; primal-dt writes its lock only to a plain "
                         f"file, so that it never overwrites another one: remove {path} (rm) if nothing of yours "
                         "needs it, and try again")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise SetupError(f"the {what} {d} is in use by {holder} (or a process it started); wait for it to end "
                         "(or stop it) and try again") from None
    return fd


def holder(directory: str | Path) -> str | None:
    """Who holds ``directory`` now, in words, or None when nobody else does. Creates and holds nothing."""
    d = Path(directory).resolve()
    if d in _held:
        return None
    try:
        fd = os.open(d / FILENAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # no lock file, or one hold() would refuse with its reason
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)


def release(directory: str | Path) -> None:
    """Give up this process's hold on ``directory`` and remove its lock file (nothing if it holds none). A child
    handed the lock (``eval.sweep``'s runs) still holds the open file; a later ``hold`` takes a new one only when
    it is free (the sweep releases after its runs have ended)."""
    d = Path(directory).resolve()
    fd = _held.pop(d, None)
    if fd is None:
        return
    try:
        if _names(fd, d / FILENAME):
            os.unlink(d / FILENAME)
    except OSError:  # a directory made read-only meanwhile: the file stays, as every lock file once did
        pass
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """The pid the holder wrote just after locking (an empty file is read again briefly)."""
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            break
        time.sleep(0.01)
    return f"process {text}" if text.isdigit() else "another process"
