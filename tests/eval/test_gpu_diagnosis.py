"""eval/gpu_diagnosis.sh, the prepared GPU diagnosis, rehearsed on the CPU; and the setup it shares with
eval/gpu_comparison.sh (eval/gpu_setup.sh), in both: a wrong command line is the usage line, and a Python that lacks
the packages, given no wheels, is one error line before any work."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def call(tmp_path, script="gpu_diagnosis.sh", **env):
    return subprocess.run(["bash", str(ROOT / "eval" / script), str(tmp_path / "no-wheels"), str(tmp_path / "out")],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_gpu_diagnosis_rehearses_on_the_cpu(tmp_path):
    import sys

    p = call(tmp_path, GPU_DIAGNOSIS_REHEARSAL="1", PYTHON=sys.executable)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(f.name for f in out.iterdir()) == ["diagnosis.json", "diagnosis.md", "diagnosis.txt"]
    res = json.loads((out / "diagnosis.json").read_text())
    assert res["device"] == "cpu" and "eager fp32" in res["arms"] and res["verdict"] in p.stdout
    assert p.stdout.startswith("== Training-step diagnosis on cpu") and "skipped: cudagraphs bf16" in p.stdout


@pytest.mark.parametrize("script", ["gpu_diagnosis.sh", "gpu_comparison.sh"])
def test_a_python_without_the_packages_and_no_wheels_is_one_error_line(script, tmp_path, one_line_error):
    bare = shutil.which("python3", path="/usr/bin:/bin")
    if bare is None or subprocess.run([bare, "-c", "import gymnasium"], capture_output=True).returncode == 0:
        pytest.skip("no Python without gymnasium here")
    p = call(tmp_path, PYTHON=bare, script=script)
    one_line_error(p, "this Python lacks gymnasium", "holds no wheels", "docs/gpu.md")
    assert [f.name for f in (tmp_path / "out").iterdir()] in ([], ["comparison.txt"])  # nothing run


@pytest.mark.parametrize("script", ["gpu_diagnosis.sh", "gpu_comparison.sh"])
def test_a_wrong_command_line_is_the_usage_line(script, tmp_path):
    p = subprocess.run(["bash", str(ROOT / "eval" / script), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("usage: ") and "WHEELS_DIR OUT_DIR" in p.stderr
    assert list(tmp_path.iterdir()) == []
