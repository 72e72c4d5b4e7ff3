"""Fetching a dataset file over HTTP into place, with the standard library: probe, stream, resume, check,
rename. The file is streamed to ``<target>.part`` beside the target (same file system, so the final rename
is atomic), its length checked against the server's, its content checked by the caller's reader, and only
then renamed to the target: a reader never sees half a file. An interrupted transfer keeps the partial
file and the next attempt asks the server for the rest (an HTTP Range request); a server that ignores the
request sends the whole file again, which replaces the partial one. Every failure is one
``DatasetNotFound`` (nothing usable was put here; the next source may have data), its message one line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.client import HTTPException
from pathlib import Path
from urllib.parse import urlparse

from tqdm import tqdm

from envs.sources import DatasetError, DatasetNotFound

PROBE_TIMEOUT = 5.0
"""seconds a TCP connection to the server may take to open: an offline machine fails in this time, not in
the minutes a name lookup or a dropped SYN can take"""
STALL_TIMEOUT = 30.0
"""seconds the server may send nothing (no answer to the request, no byte of the body) before the transfer
counts as stalled and stops, its partial file kept"""
CHUNK = 1 << 20
LINE_EVERY = 60.0  # seconds between plain progress lines when stderr is not a terminal (a log, a pipe)


def reachable(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> str | None:
    """None when a TCP connection to host:port opens within ``timeout`` s, else the reason (in a thread we stop
    waiting for: name lookups ignore socket timeouts)."""
    result: list[str | None] = [f"timed out after {timeout:.0f} s"]

    def attempt():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result[0] = None
        except OSError as exc:
            result[0] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return result[0]


def part_path(target: Path) -> Path:
    """Where the download of ``target`` is streamed to, and where an interrupted one is resumed from."""
    return target.with_name(target.name + ".part")


def fetch(url: str, target: str | Path, check: Callable[[Path], object], *, what: str = "the file",
          timeout: float = STALL_TIMEOUT, verbose: bool = True) -> Path:
    """Download ``url`` to ``target`` (its folder created), unless ``target`` exists. ``check(path)`` reads the
    complete file before it is renamed into place and raises ``DatasetError`` to refuse it (the file is then
    deleted: its bytes are what the server sends, so resuming would not mend them). One process downloads a
    given target at a time (a ``flock`` on its partial file); another waits for it, then finds the target."""
    target = Path(target)
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise DatasetError(f"cannot download {what} from {url!r}: not an http:// or https:// address")
    host, port, via = _first_hop(parsed)
    reason = reachable(host, port)
    if reason is not None:
        raise DatasetNotFound(f"cannot download {what}: {via}{host}:{port} is unreachable ({reason}); this "
                              "machine is offline or the server is down")
    fd = _hold_part(target, what, verbose)
    if fd is None:  # another process put it in place while this one waited
        return target
    part = part_path(target)
    try:
        with os.fdopen(fd, "r+b", closefd=False) as f:
            _stream(url, f, part, what, timeout, verbose)
            f.flush()
            os.fsync(f.fileno())
        try:
            check(part)
        except DatasetError as err:
            part.unlink()
            raise DatasetNotFound(f"{url} served a file that is not {what}, so it was deleted ({err})") from err
        os.replace(part, target)  # still locked: a waiting process sees the target, never a half file
    except BaseException as err:
        with contextlib.suppress(OSError):  # an empty partial file holds nothing to resume from
            if (size := os.fstat(fd).st_size) == 0 and os.stat(part).st_ino == os.fstat(fd).st_ino:
                part.unlink()
            elif isinstance(err, KeyboardInterrupt) and verbose:
                print(f"\n[envs] download interrupted: {part} keeps its {size:,} bytes, and the next attempt "
                      "resumes from there", file=sys.stderr, flush=True)
        raise
    finally:
        os.close(fd)  # drops the lock
    return target


def _first_hop(parsed) -> tuple[str, int, str]:
    """(host, port, what it is) of the first connection urllib will open for the address: the proxy that
    $http_proxy / $https_proxy names for it (urllib honours them, and $no_proxy), else the server itself."""
    proxy = urllib.request.getproxies().get(parsed.scheme)
    if proxy and not urllib.request.proxy_bypass(parsed.hostname):
        p = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        return p.hostname or "", p.port or (443 if p.scheme == "https" else 80), "the proxy "
    return parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80), ""


def _hold_part(target: Path, what: str, verbose: bool) -> int | None:
    """The partial file's descriptor, locked by this process (created empty if there is none); None when the
    target exists once the lock is ours (another process downloaded it meanwhile)."""
    part = part_path(target)
    waited = False
    while True:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            raise DatasetNotFound(f"cannot download {what} into {target.parent}: {part} cannot be written "
                                  f"({err.strerror or err})") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if verbose and not waited:
                print(f"[envs] another process is downloading {target.name} (into {part}); waiting for it",
                      file=sys.stderr, flush=True)
            waited = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        if target.exists():
            os.close(fd)
            return None
        try:  # the file we locked must still be the partial file (the holder may have deleted it)
            same = os.stat(part).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _open(url: str, start: int, timeout: float):
    """The server's response to a GET of ``url`` from byte ``start``; an HTTP error status is an HTTPError."""
    headers = {"User-Agent": "primal-dt (python urllib)", "Accept-Encoding": "identity"}
    if start:
        headers["Range"] = f"bytes={start}-"
    opener = urllib.request.build_opener()  # fresh, with the proxies set now (as the probe): urlopen's keeps its first
    return opener.open(urllib.request.Request(url, headers=headers), timeout=timeout)


def _stream(url: str, f, part: Path, what: str, timeout: float, verbose: bool) -> None:
    """Append the rest of ``url`` to the partial file ``f`` (from its current length), or all of it when the
    server ignores the range; the received length must be the server's."""
    resp, have, total = _request(url, os.fstat(f.fileno()).st_size, what, timeout, verbose)
    with resp:
        f.seek(have)
        f.truncate()
        _receive(resp, f, url, part, what, have, total, timeout, verbose)
    f.flush()
    size = os.fstat(f.fileno()).st_size  # the file's, not the position's: no stale bytes after it
    if total is not None and size != total:
        raise DatasetNotFound(f"the download of {what} from {url} is incomplete: the server announced {total:,} "
                              f"bytes and sent {size:,}; {part} keeps them, and the next attempt resumes from there")


def _request(url: str, have: int, what: str, timeout: float, verbose: bool):
    """(the server's response, the byte of the file it starts at, the file's whole length if the server says
    it): the rest of the file from byte ``have`` where the server answers the range (206), else all of it."""
    for start in (have, 0) if have else (0,):
        try:
            resp = _open(url, start, timeout)
        except urllib.error.HTTPError as err:
            err.close()
            if err.code == 416 and start:  # the range starts past the file's end: a stale partial file
                continue
            raise DatasetNotFound(f"cannot download {what}: {url} answered {err.code} {err.reason}") from err
        except (urllib.error.URLError, OSError, HTTPException) as err:
            cause = getattr(err, "reason", None) or err
            why = (f"no answer for {timeout:g} s" if isinstance(cause, TimeoutError)
                   else f"{type(cause).__name__}: {cause}")
            raise DatasetNotFound(f"cannot download {what} from {url}: {why}") from err
        if resp.status != 206:  # the whole file: a fresh start, or a server that ignores ranges
            if start and verbose:
                print(f"[envs] {url} does not resume downloads: downloading it from the start", file=sys.stderr,
                      flush=True)
            length = resp.headers.get("Content-Length", "")
            return resp, 0, int(length) if length.isdigit() else None
        m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.headers.get("Content-Range", "").strip())
        if m and int(m[1]) == start:
            if start and verbose:
                print(f"[envs] resuming the download of {url} at byte {start:,}", file=sys.stderr, flush=True)
            return resp, start, None if m[3] == "*" else int(m[3])
        resp.close()  # a range we did not ask for (HTTP forbids it): ask for the whole file
    raise DatasetNotFound(f"cannot download {what}: {url} answers range requests with ranges not asked for")


def _receive(resp, f, url: str, part: Path, what: str, have: int, total: int | None, timeout: float,
             verbose: bool) -> None:
    """Copy the body into ``f``: a bar on a terminal, a plain line a minute elsewhere."""
    if verbose:  # before the bar, which would otherwise draw its first frame on this line
        size = f"{total / 2**20:,.1f} MiB" if total else "size not announced"
        print(f"[envs] downloading {url} ({size}) to {part.parent}", file=sys.stderr, flush=True)
    bar = tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024, desc=part.name[:-5],
               mininterval=1.0, disable=not (verbose and sys.stderr.isatty()))
    start, last = time.monotonic(), time.monotonic()
    with bar:
        while True:
            try:
                block = resp.read1(CHUNK)  # what has arrived: bytes before a stall are kept too
            except (OSError, HTTPException) as err:  # TimeoutError: nothing for ``timeout`` s
                why = f"nothing received for {timeout:g} s" if isinstance(err, TimeoutError) else \
                      f"{type(err).__name__}: {err}"
                raise DatasetNotFound(f"the download of {what} from {url} stopped after {f.tell():,} of "
                                      f"{f'{total:,}' if total else 'an unknown number of'} bytes ({why}); {part} "
                                      "keeps them, and the next attempt resumes from there") from err
            if not block:
                return
            try:
                f.write(block)
            except OSError as err:
                raise DatasetNotFound(f"cannot write the download of {what} to {part} "
                                      f"({os.strerror(err.errno or errno.EIO)})") from err
            bar.update(len(block))
            if verbose and bar.disable and time.monotonic() - last >= LINE_EVERY:
                last = time.monotonic()
                print(f"[envs] {part.name[:-5]}: {f.tell() / 2**20:,.1f}"
                      f"{f' of {total / 2**20:,.1f}' if total else ''} MiB after {last - start:.0f} s",
                      file=sys.stderr, flush=True)
