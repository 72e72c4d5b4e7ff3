"""Run directories and monitoring shared by every trainer: TensorBoard, a progress bar, PNG plots. An event
file is appended to, not written atomically: a failed write is one ``errors.WriteError`` naming the
directory, a resume purges the steps after its checkpoint, and TensorBoard stops at a torn file's last record.
"""

from __future__ import annotations

import itertools
import io
import json
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from . import errors, interrupts, lock, outputs
from . import progress as progress_bars
from .checkpoint import write_atomic
from .presets import flat


def run_dir(root: str | Path, *parts: str, seed: int) -> Path:
    """A new run directory ``root/part/.../<YYYYmmdd-HHMMSS>-seed<k>``, created exclusively (a run started in
    the same second with the same seed takes ``<stamp>-1-seed<k>``, ...)."""
    base = Path(root).joinpath(*[p.replace("/", "-") for p in parts])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    names = itertools.chain([f"{stamp}-seed{seed}"], (f"{stamp}-{i}-seed{seed}" for i in itertools.count(1)))
    try:
        with errors.writing(base, "run directory"):
            base.mkdir(parents=True, exist_ok=True)
        path = outputs.new_path((base / n for n in names), Path.mkdir, what="run directory")
    except errors.WriteError as err:
        raise errors.WriteError(f"{err}; nothing was written. Choose a writable out= (now {root})") from err
    for other in sorted(path.parent.glob(f"*-seed{seed}")):  # a second run started by mistake says so at once
        who = lock.holder(other) if other != path and other.is_dir() else None
        if who is not None:
            print(f"warning: {who} is running the same dataset, model and seed in {other}; this run starts beside "
                  f"it in {path} (stop one if that was not meant)", file=sys.stderr, flush=True)
    return path


def save_figure(fig, path: str | Path, what: str, dpi: int = 110) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return write_atomic(path, buf.getvalue(), what)


def _quiet_event_writer_thread() -> None:
    """TensorBoard's writer thread hands a failed write to the thread that logs next (where it becomes a
    ``WriteError``) but first prints a traceback, which is dropped (the thread has no hook of its own)."""
    previous = threading.excepthook
    if not getattr(previous, "primal_dt", False):
        def hook(args):
            if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
                previous(args)

        hook.primal_dt = True
        threading.excepthook = hook


def _wait_for_a_later_second(log_dir: Path) -> None:
    """TensorBoard reads event files in name order, and names start with the creation second: a run resumed
    within the second its killed predecessor started waits for the next, so its purge applies."""
    fields = [p.name.split(".") for p in log_dir.glob("events.out.tfevents.*")]
    latest = max((int(f[3]) for f in fields if len(f) > 3 and f[3].isdigit()), default=0)
    while int(time.time()) <= latest:
        time.sleep(0.05)


class RunMonitor:
    """Scalars go to TensorBoard and are kept in ``history``, so the curves are drawn to PNG at the end without
    re-reading event files. ``purge_step``: TensorBoard drops what a killed predecessor wrote from it on."""

    LINE_EVERY_S = progress_bars.LINE_EVERY_S
    """without a bar (``progress=false``, as ``eval.sweep`` runs, or output that is not a terminal), a plain
    progress line at most this often, so a log read while the run goes on says how far it got"""

    def __init__(self, log_dir: str | Path, enabled: bool = True, progress_total: int | None = None,
                 progress_desc: str = "train", progress: bool = True, initial: int = 0,
                 purge_step: int | None = None, lines: bool = False):
        self.log_dir = Path(log_dir)
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.writer = None
        if enabled:
            _wait_for_a_later_second(self.log_dir)
            _quiet_event_writer_thread()
            self.writer = self._log(lambda: SummaryWriter(str(self.log_dir), purge_step=purge_step), always=True)
        drawn = progress and bool(progress_total) and progress_bars.on_terminal()  # in a file, frames are noise
        self.total, self.n, self.lines = progress_total, initial, lines and bool(progress_total) and not drawn
        self.last_line = time.monotonic()
        self.bar = (tqdm(total=progress_total, initial=initial, desc=progress_desc, dynamic_ncols=True, mininterval=1.0)
                    if drawn else None)

    def _log(self, write, always: bool = False):
        """``write()`` when there is a writer; a failure is one ``WriteError`` and ends the writer."""
        if self.writer is None and not always:
            return None
        try:  # held: an interrupt inside the writer's queue would leave its close waiting forever
            with interrupts.deferred(), errors.writing(self.log_dir, "TensorBoard event file in"):
                return write()
        except errors.WriteError:
            self.writer = None  # close() must not try again
            raise

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.history[tag].append((step, float(value)))
        self._log(lambda: self.writer.add_scalar(tag, float(value), step))

    def scalars(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.scalar(k, v, step)

    def histogram(self, tag: str, values, step: int) -> None:
        self._log(lambda: self.writer.add_histogram(tag, values, step))

    def text(self, tag: str, value: str, step: int = 0) -> None:
        self._log(lambda: self.writer.add_text(tag, value, step))

    def image(self, tag: str, data: bytes, size: tuple[int, int], step: int = 0) -> None:
        """An encoded PNG or GIF (``encode_gif``; TensorBoard plays it) of ``size`` (height, width); not torch's
        ``add_video``, which needs the ``moviepy.editor`` that moviepy 2 removed."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        image = Summary.Image(height=size[0], width=size[1], colorspace=3, encoded_image_string=data)
        self._log(lambda: self.writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]),
                                                              step))

    def hparams(self, params: dict, metrics: dict[str, float]) -> None:
        """Hyper-parameters (flattened, stringified where TensorBoard needs it) with final metrics."""
        values = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v, default=str)
                  for k, v in flat(params).items()}
        self._log(lambda: self.writer.add_hparams(values, {f"hparam/{k}": float(v) for k, v in metrics.items()},
                                                  run_name="."))

    def progress(self, n: int = 1, **postfix) -> None:
        self.n += n
        if self.lines and time.monotonic() - self.last_line >= self.LINE_EVERY_S:
            self.last_line = time.monotonic()
            done = ", ".join(f"{k} {v}" for k, v in postfix.items())
            print(f"step {self.n:,}/{self.total:,} ({100 * self.n / self.total:.0f}%){': ' * bool(done)}{done}",
                  flush=True)
        if self.bar is not None:
            with interrupts.deferred():  # tqdm's locks, which its monitor thread shares
                self.bar.update(n)
                if postfix:
                    self.bar.set_postfix(postfix, refresh=False)

    def print(self, msg: str) -> None:
        self.bar.write(msg) if self.bar is not None else print(msg, flush=True)

    def plot(self, tags: list[str], path: str | Path, title: str = "", ylabel: str = "", xlabel: str = "step"):
        """Draw the recorded curves of ``tags`` to a PNG (skipped when none has data)."""
        series = {t: self.history[t] for t in tags if self.history.get(t)}
        if not series:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for t, pts in series.items():
            ax.plot(*zip(*pts), marker="o", label=t)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        try:
            return save_figure(fig, path, "plot", dpi=100)
        finally:
            plt.close(fig)

    def flush(self) -> None:
        """Put every logged event on disk (before a checkpoint, so a killed run's curves reach it)."""
        self._log(lambda: self.writer.flush())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._log(lambda: (self.writer.flush(), self.writer.close()))
        self.writer = None


def encode_gif(frames, fps: float = 25.0) -> bytes:
    """A looping GIF of ``frames`` ([T] of H x W x 3 uint8). Delays are whole centiseconds and browsers show
    one under 2 cs as 10 cs, so the delay is ``1 / fps`` rounded to centiseconds, at least 2."""
    import numpy as np
    from PIL import Image

    if not len(frames):
        raise ValueError("encode_gif needs at least one frame")
    images = [Image.fromarray(np.asarray(f, dtype=np.uint8)) for f in frames]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], loop=0,
                   duration=10 * max(2, round(100 / fps)))
    return buf.getvalue()


class EpisodeBar(progress_bars.Bar):
    """A progress bar over evaluation episodes (x targets), ETA at the average rate (``smoothing=0``: side by
    side simulators finish episodes in bursts); the final count is always drawn. Not on a terminal: plain lines
    (``progress.Bar``)."""

    def __init__(self, total: int, desc: str, leave: bool = True):
        super().__init__(total=total, desc=desc, unit="episode", leave=leave, dynamic_ncols=True, smoothing=0)

    def update(self, n: int = 1):
        shown = super().update(n)
        if not self.plain and self.total and self.n >= self.total:
            self.refresh()
        return shown
