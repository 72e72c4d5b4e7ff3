"""eval.bench.gpu: every part of the GPU benchmark rehearsed at its budget size on whatever device is
here, and its table printed last; the prepared GPU command (eval/gpu_comparison.sh) rehearsed on the CPU."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from eval.bench import gpu

ROOT = Path(__file__).resolve().parents[3]


def test_a_device_this_machine_lacks_is_one_line(capsys):
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(SystemExit) as exit_:
        gpu.main(["--device", "cuda:7", "--budget"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --device=cuda:7")


@pytest.mark.slow
def test_the_budget_run_times_every_form_and_prints_the_table_last(tmp_path, capsys):
    path = tmp_path / "bench.json"
    res = gpu.main(["--budget", "--threads", "1", "--no-hf", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(res))
    forms = ["eager", "compile"] + ["cudagraphs"] * (res["device"].startswith("cuda"))
    assert set(res["ms_per_update"]) == {f"{lay} {form} {p}" for lay in ("dt", "primal+dt", "primalformer-dt")
                                         for form in forms for p in ("fp32", "bf16")}
    assert set(res["act_ms"]) == {"act batch 1", "act batch 100"}
    assert res["concurrent"]["many"]["processes"] == 2 and res["concurrent"]["one"]["updates_per_s"] > 0
    out = capsys.readouterr().out.rstrip().splitlines()
    table = out[out.index(next(x for x in out if x.startswith("== ms per update"))):]
    assert table[-1].startswith("2 trainings at once") and any(x.startswith("| dt eager fp32 |") for x in table)


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
    assert "6 of 6 runs finished" in summary and "== ms per update" in summary
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


@pytest.mark.slow
def test_what_the_time_budget_leaves_out_is_named_under_the_table(capsys):
    res = gpu.main(["--budget", "--no_bf16", "--budget_s", "0.001", "--threads", "1", "--no_hf"])
    assert set(res["ms_per_update"]) == {"dt eager fp32", "dt compile fp32"}  # the first part always runs
    assert res["skipped"] == ["primal+dt fp32", "primalformer-dt fp32", "concurrent trainings"]
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == (
        "not measured (--budget_s reached): primal+dt fp32, primalformer-dt fp32, concurrent trainings")
