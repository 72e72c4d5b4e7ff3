"""The inference thread policy (``agents.threads.inference_threads`` / ``lane_threads``) and the
allocator setting inference processes use (``keep_freed_memory``)."""

import os

import pytest

from agents import threads

ENGINES = ("stream", "recompute", "onnx", "torchscript")


def test_usable_cores_are_the_affinity_mask():
    assert threads.usable_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cores", [1, 2, 3, 4, 16, 64])
def test_never_more_than_half_the_cores_and_one_for_small_batches(engine, cores):
    assert threads.inference_threads(engine, 1, cores) == 1  # per-operator overhead: threads do not divide it
    for batch in (1, 4, 32, 100, 1000):
        n = threads.inference_threads(engine, batch, cores)
        assert 1 <= n <= max(1, cores // 2)
        if cores <= 3:
            assert n == 1  # a 2-core machine with one other busy process: more threads collapse
    big = threads.inference_threads(engine, 1000, cores)
    assert big == max(1, cores // 2)


@pytest.mark.parametrize("cores", [1, 2, 4, 16])
@pytest.mark.parametrize("lanes", [1, 2, 3, 8])
def test_lanes_together_never_oversubscribe_the_cores(cores, lanes):
    for engine in ENGINES:
        for batch in (1, 50, 500):
            n = threads.lane_threads(engine, batch, lanes, cores)
            assert n >= 1
            assert n * lanes <= max(cores, lanes)  # at least one thread each, else the lanes' share
            if batch >= threads.BIG_BATCH[engine]:
                assert n == max(1, cores // lanes)
            else:
                assert n == 1


def test_an_unknown_engine_is_named():
    with pytest.raises(ValueError, match="unknown inference engine 'strem'"):
        threads.inference_threads("strem", 1)


def test_keep_freed_memory_stops_the_page_faults_of_repeated_big_buffers(run_code):
    """A real process that, like an inference step, allocates a big buffer and frees it every step. The
    buffer (40 MB) is above the 32 MB ceiling of glibc's adaptive mmap threshold, so with glibc's defaults
    it is mapped fresh and unmapped on free every time, and each step faults its pages in anew; once
    inference memory is kept, reuse costs no page fault. (Smaller buffers are not a reliable probe: glibc
    raises its threshold after the first free, and whether the heap top is trimmed depends on what else
    the process allocated.) The test counts faults step by step and asks that most steps cost none: the
    kernel may still fault a kept buffer in now and then (reclaim, NUMA balancing, a CI host's memory
    pressure), which is not the allocator's doing."""
    code = """
import resource, sys, torch
from agents import threads
def step():
    return torch.ones(10 << 20)[0]
def faults():
    for _ in range(3):
        step()
    counts = []
    for _ in range(20):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return ",".join(map(str, counts))
before = faults()
applied = threads.keep_freed_memory()
print(before, faults(), applied, threads.keep_freed_memory())
"""
    p = run_code(code)
    assert p.returncode == 0, p.stderr[-3000:]
    before, after, applied, again = p.stdout.split()
    if applied != "True":
        pytest.skip("no glibc mallopt here")
    before, after = ([int(n) for n in counts.split(",")] for counts in (before, after))
    faulting = lambda counts: sum(n >= 20 for n in counts)  # 10,240 pages a step with 4 KB pages, 20 with huge
    if faulting(before) < 15:
        pytest.skip(f"this process's allocator keeps freed memory already (faults per step: {before}): "
                    "MALLOC_* settings or a preloaded allocator")
    assert faulting(after) <= 5, f"faults per step with freed memory kept: {after} (before: {before})"
    assert again == "True"
