"""Ctrl-C and SIGTERM (a cluster's time limit) as one interrupt for both trainers, so each can end with a
checkpoint it names and the resume line, and never with a write cut in half.

Why not let the interrupt land anywhere: a ``KeyboardInterrupt`` raised inside TensorBoard's event writer (its
queue and worker thread) leaves the writer's close waiting forever, and a half-written step would resume
inexactly. So the regions that must not be cut (a step and its log line, a checkpoint, every call into the
event writer) are ``held``: an interrupt arriving there waits for the region's end."""

from __future__ import annotations

import contextlib
import signal
import threading

_active: Interrupts | None = None
"""The handler installed by the running trainer (``deferred`` holds its regions), if any."""


class Interrupts:
    """The handler: an interrupt arriving inside a ``held`` region (regions nest) waits for its end; a second
    stops at once. A SIGINT ignored when the process started (a background job) stays ignored."""

    def __init__(self):
        self.depth, self.pending = 0, None

    def _handle(self, signum, frame):
        args = ("SIGTERM",) if signum == signal.SIGTERM else ()
        if self.depth and self.pending is None:
            self.pending = args
            return
        raise KeyboardInterrupt(*args)

    @contextlib.contextmanager
    def installed(self):
        global _active
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        outer, _active = _active, self
        signal.signal(signal.SIGTERM, self._handle)
        if previous[signal.SIGINT] is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _active = outer

    @contextlib.contextmanager
    def held(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.depth == 0 and self.pending is not None:
            args, self.pending = self.pending, None
            raise KeyboardInterrupt(*args)


def deferred():
    """A region the installed handler holds, for code that does not know which command runs it, such as the
    event writer's calls in ``RunMonitor``. Where no trainer installed one (``eval.video``),
    a handler is installed for the region: the interrupt lands at its end, as a ``KeyboardInterrupt``."""
    return _active.held() if _active is not None else _own_region()


@contextlib.contextmanager
def _own_region():
    own = Interrupts()
    with own.installed(), own.held():
        yield
