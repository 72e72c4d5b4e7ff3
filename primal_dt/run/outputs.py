"""Claiming a new output (a run directory, a report, an export) under a name no other process holds, and
checking early that a directory can be written (before an hour of work, not after)."""

from __future__ import annotations

import errno
import itertools
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import writing


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
