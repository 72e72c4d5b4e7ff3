"""How many CPU threads an inference process runs, and the allocator setting it runs with."""

from __future__ import annotations

import ctypes
import functools

from primal_dt.run.runtime import usable_cores

BIG_BATCH = {"recompute": 8, "stream": 32, "onnx": 32, "torchscript": 32}
"""every inference engine, with the rows from which its step is large matmuls rather than per-operator overhead
(below, no thread count helps: eval.bench.inference); recompute runs 3K tokens per row"""


def inference_threads(engine: str, batch: int, cores: int | None = None) -> int:
    """CPU threads for one inference process acting for ``batch`` rows with ``engine`` (``threads=0`` of the
    evaluators): one for small batches, else half the cores, since a multi-threaded step waits at every
    operator for its slowest thread and collapses when a busy process shares a thread's core."""
    return lane_threads(engine, batch, 2, cores)


def lane_threads(engine: str, batch: int, lanes: int, cores: int | None = None) -> int:
    """Threads for each of ``lanes`` processes acting side by side: 1 for small batches, else a share."""
    if engine not in BIG_BATCH:
        raise ValueError(f"unknown inference engine {engine!r}; choose one of {', '.join(BIG_BATCH)}")
    if batch < BIG_BATCH[engine]:
        return 1
    return max(1, (usable_cores() if cores is None else max(1, int(cores))) // max(1, int(lanes)))


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc keep freed memory (once per process): a step frees and allocates the same large buffers, which
    glibc would otherwise unmap and map afresh (page faults each step). Returns whether it applied."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    return bool(mallopt(M_MMAP_THRESHOLD, 64 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
