"""Progress bars only where someone watches them. On a terminal a tqdm bar; written to a file or a pipe (a
sweep's log, ``| tee``, a cluster job's output) a bar is hundreds of carriage-return frames, so there the bar
is off and a plain line says how far the work got: at the first step of progress (the work has begun), then
at most once every ``LINE_EVERY_S``.
Imports nothing from the project (``envs`` uses it)."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

LINE_EVERY_S = 60.0
"""the most often a plain progress line is printed where no bar is drawn"""


def on_terminal(stream=None) -> bool:
    """Whether ``stream`` (default: stderr, where tqdm draws) is a terminal, the one place bars are drawn."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False


class Bar(tqdm):
    """tqdm's bar on a terminal; elsewhere no frames but ``desc: n/total unit (p%), postfix`` on stdout at the first
    update and then once a ``LINE_EVERY_S`` at most (``progress=False``: neither). Takes tqdm's arguments."""

    def __init__(self, *args, progress: bool = True, **kw):
        self.plain = progress and not on_terminal(kw.get("file"))
        super().__init__(*args, **kw, disable=not progress or self.plain)
        unit = kw.get("unit", "it")
        self.plain_desc, self.plain_unit, self.plain_postfix = kw.get("desc") or "", f"{unit}s" * (unit != "it"), ""
        self.plain_last = -float("inf")  # the first update says the work is under way

    def update(self, n: float | None = 1):
        if not self.plain:
            return super().update(n)
        self.n += n or 0  # a disabled tqdm counts nothing; callers read ``n``
        if time.monotonic() - self.plain_last >= LINE_EVERY_S:
            self.plain_last = time.monotonic()
            print(self.plain_line(), flush=True)
        return None

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        if not self.plain:
            return super().set_postfix(ordered_dict, refresh, **kwargs)
        self.plain_postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kwargs}.items())
        return None

    def plain_line(self) -> str:
        """``eval at step 10: 2/4 episodes (50%), ret=3100``: tqdm's unit in the plural, "it" left out."""
        of, share = (f"/{self.total:,}", f" ({100 * self.n / self.total:.0f}%)") if self.total else ("", "")
        unit = f" {self.plain_unit}" if self.plain_unit else ""
        return f"{self.plain_desc}: {self.n:,}{of}{unit}{share}" + (f", {self.plain_postfix}" if self.plain_postfix
                                                                   else "")
