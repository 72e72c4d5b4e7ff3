"""How many CPU threads an inference process runs, and the allocator setting it runs with: the thread
policy of the agents' runtimes (torch agents, exported runtimes), for the evaluators and benchmarks
that host them. Threads are chosen for the engine and the batch, since a small batch's step is
per-operator overhead that threads do not divide, and lanes side by side share the cores."""

from __future__ import annotations

from primal_dt.run.runtime import usable_cores
from agents.train_config import ENGINES

INFERENCE_ENGINES = (*ENGINES, "onnx", "torchscript")
"""the torch engines and the exported runtimes"""
BIG_BATCH = {"stream": 32, "onnx": 32, "torchscript": 32, "recompute": 8}
"""rows from which an engine's step is arithmetic (large matmuls) rather than per-operator overhead:
below it no thread count helps (eval.bench.inference measures it); recompute runs 3K tokens per row, so
its matmuls are large sooner."""


def inference_threads(engine: str, batch: int, cores: int | None = None) -> int:
    """CPU threads for one inference process acting for ``batch`` rows with ``engine`` on ``cores`` cores
    (``threads=0`` of the evaluators). Never more than half the cores: a multi-threaded step waits at every
    operator for its slowest thread, so one busy process on a thread's core makes it collapse; small
    batches get one (their step is per-operator overhead, which threads do not divide)."""
    if engine not in INFERENCE_ENGINES:
        raise ValueError(f"unknown inference engine {engine!r}; choose one of {', '.join(INFERENCE_ENGINES)}")
    cores = usable_cores() if cores is None else max(1, int(cores))
    if batch < BIG_BATCH[engine]:
        return 1
    return max(1, cores // 2)


def lane_threads(engine: str, batch: int, lanes: int, cores: int | None = None) -> int:
    """Threads for each of ``lanes`` processes acting side by side: one for small batches, else the lane's
    share of the cores, so the lanes together never oversubscribe the machine."""
    if inference_threads(engine, batch, cores) == 1 and batch < BIG_BATCH[engine]:
        return 1
    cores = usable_cores() if cores is None else max(1, int(cores))
    return max(1, cores // max(1, int(lanes)))


_ALLOCATOR_TUNED = False


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse: an inference step allocates and frees the same large buffers
    every step, which glibc would otherwise map fresh and unmap, paying page faults again each step. A
    no-op where ``mallopt`` is absent; returns whether it applied."""
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    _ALLOCATOR_TUNED = bool(mallopt(M_MMAP_THRESHOLD, 64 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
    return _ALLOCATOR_TUNED
