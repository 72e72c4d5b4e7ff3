"""The command behind the default training's decision (eval/fidelity_comparison.sh), rehearsed small: it
trains both ways, evaluates the standard checkpoints by both engines, keeps the three policies apart in
one report, and a second call finds everything done; FIDELITY_OPTIONS trains every run of a sweep of its own
with an option (a learning-rate schedule), which the report names and sets against the constant rate."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents import dt_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_fidelity_comparison_rehearses_and_resumes(tmp_path):
    env = {**os.environ, "FIDELITY_REHEARSAL": "1", "FIDELITY_ENVS": "hopper-medium", "FIDELITY_MODELS": "dt",
           "FIDELITY_SEEDS": "0", "FIDELITY_WINDOWS": "4:40",  # (W:K; a rehearsal keeps its own K)
           "FIDELITY_PREFIX_MODELS": "primalformer-dt", "FIDELITY_EPISODES": "2", "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT)}
    cmd = ["bash", str(ROOT / "eval" / "fidelity_comparison.sh"), str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    md = (tmp_path / "report" / "scores.md").read_text()
    engines = {ln.split("|")[4].strip() for ln in md.splitlines() if ln.startswith("| hopper-medium | replica | dt")}
    assert engines == {"recompute", "stream (not trained)", "stream (exact, window 4)", "stream (exact, whole episodes)",
                       # and each run's average:
                       "recompute, EMA 0.999", "stream (exact, window 4), EMA 0.999",
                       "stream (exact, whole episodes), EMA 0.999"}
    prefix = {ln.split("|")[4].strip() for ln in md.splitlines()
              if ln.startswith("| hopper-medium | replica | primalformer-dt")}
    assert prefix == {"stream (exact, from start)", "stream (exact, from start), EMA 0.999"}
    (run,) = (tmp_path / "standard" / "hopper-medium" / "dt").glob("*-seed0")
    assert (run / "rollout-stream.json").exists() and (run / "rollout-recompute-ema.json").exists()

    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(b)" not in again.stdout and "(e)" not in again.stdout and again.stdout.count("0 to start, 0 to resume, 1 finished") == 4
    only_a = subprocess.run(cmd, env={**env, "FIDELITY_WINDOWS": "", "FIDELITY_PREFIX_MODELS": "", "FIDELITY_WHOLE_MODELS": ""},
                            capture_output=True, text=True, timeout=900)  # empty: that part left out, not its default
    assert only_a.returncode == 0 and "(a)" in only_a.stdout, only_a.stderr[-3000:]
    assert "(c)" not in only_a.stdout and "(d)" not in only_a.stdout and "(f)" not in only_a.stdout

    part = {"FIDELITY_WINDOWS": "", "FIDELITY_PREFIX_MODELS": "", "FIDELITY_WHOLE_MODELS": ""}
    cosine = subprocess.run(cmd[:-1] + [str(tmp_path / "cosine")],
                            env={**env, **part, "FIDELITY_OPTIONS": "lr_schedule=cosine lr_min=0.5"},
                            capture_output=True, text=True, timeout=900)
    assert cosine.returncode == 0, cosine.stdout[-3000:] + cosine.stderr[-3000:]
    (run,) = (tmp_path / "cosine" / "standard" / "hopper-medium" / "dt").glob("*-seed0")
    config = dt_checkpoint.load(run).config
    assert (config["lr_schedule"], config["lr_min"], config["recipe"]) == ("cosine", 0.5, "preset")  # and the rehearsal's
    both = subprocess.run([sys.executable, "-m", "eval.report", str(tmp_path / "standard"), str(tmp_path / "cosine" / "standard"),
                           f"out={tmp_path / 'both'}"], env=env, capture_output=True, text=True, timeout=900)
    assert both.returncode == 0, both.stderr[-3000:]
    md = (tmp_path / "both" / "scores.md").read_text()
    assert "| hopper-medium | replica | dt | recompute, lr cosine to 0.5 | 1 |" in md
    assert "| hopper-medium | replica | dt | recompute, lr cosine to 0.5, EMA 0.999 | 1 |" in md
    assert "lr_schedule=cosine) against the constant rate" in md
