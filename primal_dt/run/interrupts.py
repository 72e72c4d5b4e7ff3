"""Ctrl-C and SIGTERM (a cluster's time limit) as one interrupt for both trainers, so each can end with a
checkpoint it names and the resume line, and never with a write cut in half."""

from __future__ import annotations

import contextlib
import signal
import threading


class Interrupts:
    """Ctrl-C and SIGTERM end training alike, with a checkpoint at the step reached. One during a step or
    its log line (``held``) waits for their end, so that checkpoint resumes exactly; a second stops at once.
    A SIGINT ignored when the process started (a background job) stays ignored."""

    def __init__(self):
        self.holding, self.pending = False, None

    def _handle(self, signum, frame):
        args = ("SIGTERM",) if signum == signal.SIGTERM else ()
        if self.holding and self.pending is None:
            self.pending = args
            return
        raise KeyboardInterrupt(*args)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        signal.signal(signal.SIGTERM, self._handle)
        if previous[signal.SIGINT] is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._handle)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def held(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending is not None:
            args, self.pending = self.pending, None
            raise KeyboardInterrupt(*args)
