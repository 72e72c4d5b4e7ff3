"""The one reader of JSON the package did not just write (it may be damaged, planted or not a file): whatever is
wrong is one ``JSONError`` naming it, never a hang or an exhausted memory. Only a regular file is read, at most
``MAX_BYTES``; nesting past ``MAX_DEPTH`` is refused before the (recursive) parser; numbers must be finite and at
most ``MAX_MAGNITUDE``. Every step is linear in the input (the depth pre-scan included: a file of escaped quotes
must not cost the square of its size), so the size cap bounds the time too. Standard library only."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from itertools import accumulate
from pathlib import Path
from typing import Any

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_MAGNITUDE = 1e15
"""above any score, statistic, count or seed a primal-dt file records"""

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
"""a JSON string, or an unterminated one to the end: every match ends where the next search starts, so the scan is
linear (a closing quote that must be there would make each unterminated ``"`` a scan to the end, quadratic in all)"""
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class JSONError(ValueError):
    """A JSON file or text that cannot be used, with its name and why."""


def read(path: str | Path, nonfinite: bool = False) -> Any:
    """The JSON document in the regular file ``path``, checked as ``parse`` checks it."""
    path, fd = Path(path), None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO opens without a writer
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise JSONError(f"{path} is not a regular file (a FIFO, device or directory); give a JSON file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise JSONError(f"{path} cannot be read: {err.strerror}") from None
    finally:
        if fd is not None:
            os.close(fd)
    if len(data) > MAX_BYTES:
        raise JSONError(f"{path} is larger than {MAX_BYTES:,} bytes, more than any file of this kind holds; "
                        "it is not one primal-dt wrote")
    return parse(data, str(path), nonfinite)


def parse(text: str | bytes, where: str, nonfinite: bool = False) -> Any:
    """The JSON document ``text`` from ``where``. ``nonfinite``: accept NaN and +-Infinity (a summary's diverged
    score, flagged by its reader)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise JSONError(f"{where} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    depth = _depth(text)
    if depth > MAX_DEPTH:
        raise JSONError(f"{where} nests {depth} levels deep, more than the {MAX_DEPTH} any primal-dt file has")
    try:
        value = json.loads(text, parse_int=lambda s: _number(int(s) if len(s) <= 20 else math.inf, s, where),
                           parse_float=lambda s: _number(float(s), s, where),
                           parse_constant=lambda s: float(s) if nonfinite else _number(math.nan, s, where))
    except json.JSONDecodeError as err:
        raise JSONError(f"{where} is not valid JSON ({err})") from None
    try:  # "\ud800" is valid JSON but no text: printed or written, it fails far from here, the file unnamed
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(err.object[err.start])
        raise JSONError(f"{where} holds a string that is not text (the lone surrogate \\u{code:04x}); the file is "
                        "damaged or not one primal-dt wrote") from None
    return value


def _number(value: float, text: str, where: str) -> float:
    if not abs(value) <= MAX_MAGNITUDE:  # NaN fails this too
        raise JSONError(f"{where} holds the number {text[:30]}{'...' if len(text) > 30 else ''}, not a finite "
                        f"number of at most {MAX_MAGNITUDE:g} in size; the file is damaged or not one primal-dt wrote")
    return value


def _depth(text: str) -> int:
    """How deeply ``text``'s arrays and objects nest (brackets inside strings do not count), in one linear pass."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)
