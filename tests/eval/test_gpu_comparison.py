"""eval/gpu_comparison.sh, the prepared GPU command (tests, benchmark, paper recipe, report), rehearsed on the
CPU."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_command_rehearses_on_the_cpu(tmp_path):  # in bf16 autocast, to check GPU_COMPARISON_AMP
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "GPU_COMPARISON_REHEARSAL": "1", "GPU_COMPARISON_WORK": str(work),
           "GPU_COMPARISON_BUDGET_S": "900", "GPU_COMPARISON_AMP": "bf16", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(["bash", str(ROOT / "eval" / "gpu_comparison.sh"), str(tmp_path / "no-wheels"), str(out)],
                       env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    files = sorted(f.name for f in out.iterdir())
    assert len(files) <= 8 and {"bench.txt", "bench.json", "sweep.log", "comparison.txt", "scores.md"} <= set(files)
    summary = (out / "comparison.txt").read_text()
    assert "6 of 6 runs finished" in summary and "== Training step on cpu" in summary
    assert {"ours:primal+dt", "ours:primal+dt[compile]"} <= set(json.loads((out / "bench.json").read_text())
                                                                ["results"][0]["models"])
    # the CUDA tests ran first: collected and, on a CPU, skipped (a GPU machine runs them)
    assert re.search(r"CUDA paths \(tests/test_cuda.py\): exit 0 after \d+s: \d+ skipped", summary), summary[:2000]
    assert "cuda-tests.txt" in files
    assert len(list(work.glob("runs/hopper-medium/*/*/summary.json"))) == 6 and "amp=bf16" in summary
    logs = [p.read_text() for p in work.glob("runs/sweep-logs/*.log")]  # each run's config dump
    assert len(logs) == 6 and all(re.search(r"^\s*amp\s+= 'bf16'", log, re.M) for log in logs), logs[0][:2000]
    # a second call on the same work folder (how a stopped comparison is continued), without tests or benchmark
    again, out = {**env, "GPU_COMPARISON_TESTS_S": "0", "GPU_COMPARISON_BENCH_S": "0"}, tmp_path / "out2"
    p = subprocess.run(["bash", str(ROOT / "eval" / "gpu_comparison.sh"), str(tmp_path / "no-wheels"), str(out)],
                       env=again, capture_output=True, text=True, timeout=600)
    summary = (out / "comparison.txt").read_text()
    assert p.returncode == 0 and "benchmark: not run (GPU_COMPARISON_BENCH_S=0)" in summary, summary[-3000:]
    assert "6 of 6 runs finished" in summary and "scores.md" in {f.name for f in out.iterdir()}
    assert "bench.txt" not in {f.name for f in out.iterdir()} and "CUDA paths: not tested" in summary
