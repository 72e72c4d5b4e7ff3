"""Claiming a new output (a run directory, a report, an export) under a name no other process holds, writing
only where the command was told to (never through a link planted in its output), and checking early that a
directory can be written (before an hour of work, not after)."""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import SetupError, writing


def new_path(candidates: Iterable[Path], create: Callable[[Path], None], what: str = "output") -> Path:
    """The first of ``candidates`` that ``create`` makes (it fails with ``FileExistsError`` when the path exists:
    ``Path.mkdir``, ``create_file``), so two runs never pick one name, as a check then a create would let them."""
    for path in candidates:
        with writing(path, what):
            try:
                create(path)
            except FileExistsError:
                continue
        return path
    raise ValueError("no candidate path left")


def check_writable(directory: Path, what: str) -> None:
    """A ``WriteError`` now when files cannot be created in ``directory`` (a resumed run's, made read-only)."""
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
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask decides, as for every file written


@contextmanager
def new_file(path: Path, what: str) -> Iterator[Path]:
    """A new empty file, ``path`` or its first free ``numbered`` name, claimed before the work that fills it inside
    this block (so a process started alongside cannot take it); a failure inside leaves no empty file there."""
    claimed = new_path(numbered(path), create_file, what)
    try:
        yield claimed
    except BaseException:
        if claimed.exists() and claimed.stat().st_size == 0:
            claimed.unlink()  # the name claimed for an output that never came
        raise


def no_links(root: Path, path: Path, what: str) -> None:
    """A ``SetupError`` when ``path`` or a folder between ``root`` and it is a symbolic link, or ``path`` is a file
    with another name too (a hard link): what a command keeps under ``root`` stays there, since a link planted
    there would carry its writes (a log appended, a run resumed) to a file or run outside ``root``."""
    root, path = Path(root), Path(path)
    at = root
    for part in path.relative_to(root).parts:
        at = at / part
        if problem := _not_plain(at, os.lstat(at) if os.path.lexists(at) else None, last=at == path):
            raise SetupError(f"{at} is {problem}; {what} writes only inside {root}, never through a link: remove "
                             f"{at} (rm) if nothing of yours needs it, or choose another out=")


def open_append(path: Path, what: str):
    """``path`` (created if missing) open for appending as a text file, refused as ``no_links`` refuses it when a
    link was planted since the check: the file opened is never a link's target."""
    with writing(path, what):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         0o666)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            fd = None
    info = os.fstat(fd) if fd is not None else os.lstat(path)
    if problem := _not_plain(path, info, last=True):
        if fd is not None:
            os.close(fd)
        raise SetupError(f"the {what} {path} is {problem}; it is written only as a plain file: remove it (rm) if "
                         "nothing of yours needs it, and try again")
    return os.fdopen(fd, "a")


def taken(path: Path, what: str, option: str) -> str | None:
    """Why ``claimed`` (without ``replace``) would refuse ``path`` now, in words; None when it is free."""
    if not os.path.lexists(path):
        return None
    busy = _busy(path)
    return (f"{option}={path} {'is being written by another process now' if busy else 'exists'} (an earlier {what}"
            f"{'' if busy else '?'}); choose another path{'' if busy else ', or pass overwrite=true'}")


@contextmanager
def claimed(path: Path, what: str, option: str, replace: bool) -> Iterator[Path]:
    """``path`` held by this process for the ``what`` it writes by the end of this block (through
    ``write_atomic``): created exclusively unless ``replace`` (an existing file is then left as it is until the
    writer replaces it), never through a link, and locked (``flock``) meanwhile, so a second writer given the same
    ``option=`` is refused at once rather than one of the two outputs lost. A failure inside leaves no empty
    file where none was."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (0 if replace else os.O_EXCL)
    created = not os.path.lexists(path)  # (only for the cleanup: O_EXCL is what decides who creates it)
    with writing(path, what):
        path.parent.mkdir(parents=True, exist_ok=True)  # as the writer would: out= may name a folder still to make
        try:
            fd = os.open(path, flags, 0o666)
        except FileExistsError:
            raise SetupError(taken(path, what, option) or f"{option}={path} exists; choose another path") from None
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise SetupError(f"{option}={path} is a symbolic link (to {os.readlink(path)}); a {what} is written "
                             "only to a plain file: remove the link or choose another path") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SetupError(f"{option}={path} is being written by another process now (a second {what} to one file "
                         "would replace the first); wait for it to end, or choose another path") from None
    try:
        yield path
    except BaseException:
        with_it = os.fstat(fd)
        if created and with_it.st_size == 0 and _same(path, with_it):
            os.unlink(path)  # the name claimed for an output that never came
        raise
    finally:
        os.close(fd)


def _busy(path: Path) -> bool:
    """Whether another process holds ``claimed``'s lock on ``path`` now."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _same(path: Path, info: os.stat_result) -> bool:
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino)


def _not_plain(path: Path, info: os.stat_result | None, last: bool) -> str | None:
    """What ``path`` is, in words, when a command must not write through it (None when it may): a symbolic link,
    and as its last part, a file with more than one name (whatever is written there lands in the other too)."""
    if info is None:
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"a symbolic link (to {os.readlink(path)})"
    if last and stat.S_ISREG(info.st_mode) and info.st_nlink != 1:
        return f"a file with {info.st_nlink} names (a hard link)"
    return None
