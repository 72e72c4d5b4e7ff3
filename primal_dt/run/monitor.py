"""Run monitoring shared by every trainer: TensorBoard scalars/hparams, a progress bar, PNG plots.

One ``RunMonitor`` per run directory. Scalars go to TensorBoard as they come and are also kept
in memory so that curves people look at (eval return vs step, accuracy vs epoch) can be drawn to
PNG at the end without re-reading event files. A write that fails (disk full, a file-size limit)
is one ``errors.WriteError`` naming the file, not TensorBoard's thread traceback.
"""

from __future__ import annotations

import itertools
import json
import threading
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from . import errors, lock, outputs


def run_dir(root: str | Path, *parts: str, seed: int) -> Path:
    """Create a new run directory ``root/part/.../<YYYYmmdd-HHMMSS>-seed<k>`` and return it.

    The directory is created exclusively: when another run (started in the same second, with the
    same seed) holds the name, this one takes ``<stamp>-1-seed<k>``, ``<stamp>-2-seed<k>``, ... A
    name checked first and created later could be taken by both runs in between, and their
    checkpoints, summaries and event files would mix. An unwritable ``root`` is a ``WriteError``."""
    base = Path(root).joinpath(*[p.replace("/", "-") for p in parts])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    names = itertools.chain([f"{stamp}-seed{seed}"], (f"{stamp}-{i}-seed{seed}" for i in itertools.count(1)))
    try:
        with errors.writing(base, "run directory"):
            base.mkdir(parents=True, exist_ok=True)
        path = outputs.new_path((base / n for n in names), Path.mkdir, what="run directory")
    except errors.WriteError as err:
        raise errors.WriteError(f"{err}; nothing was written. Choose a writable out= (now {root})") from err
    warn_running_siblings(path, seed)
    return path


def warn_running_siblings(path: Path, seed: int) -> None:
    """One line on stderr for each run of the same dataset, model and seed still running beside the new
    run ``path`` (it holds its directory's lock): a second run started by mistake then says so at once,
    rather than both running on silently at half speed. Runs never share a directory, so this is no error."""
    for other in sorted(path.parent.glob(f"*-seed{seed}")):
        who = lock.holder(other) if other != path and other.is_dir() else None
        if who is not None:
            print(f"warning: {who} is running the same dataset, model and seed in {other}; this run starts beside "
                  f"it in {path} (stop one if that was not meant)", file=sys.stderr, flush=True)


def save_figure(fig, path: str | Path, what: str, dpi: int = 110) -> Path:
    """A matplotlib figure as a PNG at ``path``, drawn in memory and written atomically
    (``checkpoint.write_atomic``): a failed write is one ``WriteError`` naming the file and ``what`` it
    held, and leaves no partial PNG."""
    import io

    from .checkpoint import write_atomic

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return write_atomic(path, buf.getvalue(), what)


def _quiet_event_writer_thread() -> None:
    """TensorBoard's event-file writer thread hands a failed write to the thread that logs next
    (where ``RunMonitor`` makes it a ``WriteError``), but first prints it as a thread traceback;
    that traceback is kept quiet so a full disk reads as one message."""
    previous = threading.excepthook
    if getattr(previous, "primal_dt", False):
        return

    def hook(args):
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    hook.primal_dt = True
    threading.excepthook = hook


def _wait_for_a_later_second(log_dir: Path) -> None:
    """TensorBoard reads a directory's event files in name order, and names start with the creation
    second, then host and pid. A run resumed within the second its killed predecessor started could
    sort first and have its curves read before the older ones; waiting (< 1 s) for the next second
    keeps the order, so the purge of the predecessor's post-checkpoint steps works."""
    stamps = [int(p.name.split(".")[3]) for p in log_dir.glob("events.out.tfevents.*")
              if len(p.name.split(".")) > 3 and p.name.split(".")[3].isdigit()]
    while stamps and int(time.time()) <= max(stamps):
        time.sleep(0.05)


class RunMonitor:
    def __init__(self, log_dir: str | Path, enabled: bool = True, progress_total: int | None = None,
                 progress_desc: str = "train", progress: bool = True, initial: int = 0,
                 purge_step: int | None = None):
        """``purge_step``: when continuing a run in the same directory, TensorBoard drops events a
        killed predecessor wrote at steps >= purge_step (those after its last checkpoint)."""
        self.log_dir = Path(log_dir)
        self.enabled = enabled
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.writer = None
        if enabled:
            _wait_for_a_later_second(self.log_dir)
            _quiet_event_writer_thread()
            with self._writing():
                self.writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)
        self.bar = None
        if progress and progress_total:
            from tqdm import tqdm

            self.bar = tqdm(total=progress_total, initial=initial, desc=progress_desc, dynamic_ncols=True,
                            mininterval=1.0)

    @contextmanager
    def _writing(self):
        with errors.writing(self.log_dir, "TensorBoard event file in"):
            try:
                yield
            except OSError:
                self.writer = None  # it failed; close() must not try again
                raise

    def scalar(self, tag: str, value: float, step: int) -> None:
        value = float(value)
        self.history[tag].append((step, value))
        if self.writer is not None:
            with self._writing():
                self.writer.add_scalar(tag, value, step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.scalar(k, v, step)

    def histogram(self, tag: str, values, step: int) -> None:
        if self.writer is not None:
            with self._writing():
                self.writer.add_histogram(tag, values, step)

    def text(self, tag: str, value: str, step: int = 0) -> None:
        if self.writer is not None:
            with self._writing():
                self.writer.add_text(tag, value, step)

    def video(self, tag: str, frames, step: int = 0, fps: float = 25.0) -> bytes:
        """Log ``frames`` ([T] of H x W x 3 uint8) as an animated GIF, which TensorBoard plays in its
        Images tab; returns the GIF's bytes (``encode_gif``), so a caller saving the file writes the
        same animation. torch's ``add_video`` is not used: it encodes through ``moviepy.editor``,
        which moviepy 2 removed, and without it logs an empty image after printing a warning."""
        data = encode_gif(frames, fps)
        self.image(tag, data, frames[0].shape[:2], step)
        return data

    def image(self, tag: str, data: bytes, size: tuple[int, int], step: int = 0) -> None:
        """Log an encoded image (``data``: a GIF or PNG of ``size`` (height, width)) under ``tag``."""
        if self.writer is not None:
            from tensorboard.compat.proto.summary_pb2 import Summary

            image = Summary.Image(height=size[0], width=size[1], colorspace=3, encoded_image_string=data)
            with self._writing():
                self.writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)

    def hparams(self, params: dict, metrics: dict[str, float]) -> None:
        """Record hyper-parameters (flattened, stringified where TensorBoard needs it) with final metrics."""
        flat = {k: (v if isinstance(v, (int, float, str, bool)) else json.dumps(v, default=str))
                for k, v in _flatten(params).items()}
        if self.writer is not None:
            with self._writing():
                self.writer.add_hparams(flat, {f"hparam/{k}": float(v) for k, v in metrics.items()}, run_name=".")

    def progress(self, n: int = 1, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def print(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

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
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=t)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        try:
            return save_figure(fig, path, "plot", dpi=100)
        finally:
            plt.close(fig)

    def flush(self) -> None:
        """Put every logged event on disk (before a checkpoint, so a killed run's curves reach it)."""
        if self.writer is not None:
            with self._writing():
                self.writer.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            with self._writing():
                self.writer.flush()
                self.writer.close()
            self.writer = None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def encode_gif(frames, fps: float = 25.0) -> bytes:
    """An animated GIF of ``frames`` ([T] of H x W x 3 uint8), looping. GIF frame delays are whole
    centiseconds and browsers show a delay under 2 cs as 10 cs, so the delay is ``1 / fps`` rounded
    to centiseconds, at least 2 (25 fps plays 4 cs frames exactly). Identical consecutive frames are
    merged by the encoder (their delays add up)."""
    import io

    import numpy as np
    from PIL import Image

    if not len(frames):
        raise ValueError("encode_gif needs at least one frame")
    images = [Image.fromarray(np.asarray(f, dtype=np.uint8)) for f in frames]
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], loop=0,
                   duration=10 * max(2, round(100 / fps)))
    return buf.getvalue()


class EpisodeBar(tqdm):
    """A progress bar over evaluation episodes, ``total`` = episodes x targets, advanced by
    ``eval.episodes.run_episodes``' ``on_episode``: it ends at 100 % when the evaluation does, whatever
    the episodes' lengths. Its ETA is the remaining episodes at the average rate so far
    (``smoothing=0``): simulators side by side finish episodes in bursts, which a moving average of
    the rate would follow up and down. The final count is always drawn, also by a bar that is
    cleared when it closes (``leave=False``, training's evaluation), so a log shows it completed."""

    def __init__(self, total: int, desc: str, leave: bool = True):
        super().__init__(total=total, desc=desc, unit="episode", leave=leave, dynamic_ncols=True, smoothing=0)

    def update(self, n: int = 1):
        shown = super().update(n)
        if self.total and self.n >= self.total:
            self.refresh()
        return shown
