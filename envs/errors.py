"""Exceptions for offline data, so callers can tell 'nothing there' from 'something wrong there'.

``DatasetNotFound`` lets the loader fall through to the next source; ``DatasetError`` (a bad file,
wrong simulator, corrupt values) stops it, because silently training on other data than the
file the user put in place would be worse than failing.
"""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset exists but cannot be used; the message says what, where and what to do."""


class DatasetNotFound(FileNotFoundError):
    """No dataset at the place a source looks; the next source may still have one."""
