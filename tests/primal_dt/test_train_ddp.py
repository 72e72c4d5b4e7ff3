"""The training script under torchrun: DistributedDataParallel on CPU (gloo), 2 processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agents import dt_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def torchrun(hopper_file, out, *extra, status=0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "primal_dt.train", "preset=smoke", f"data_source=d4rl:{hopper_file}", f"out={out}",
           "progress=false", "model.d_model=32", "model.n_layers=2", "model.s=8", "K=5", "batch_size=8",
           "log_every=4", "eval.every=0", "threads=1", "device=cpu", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out_text = p.stdout + p.stderr
    assert p.returncode == status, out_text[-3000:]
    return out_text


def test_two_process_gloo_run_keeps_replicas_identical(hopper_file, tmp_path):
    out = torchrun(hopper_file, tmp_path, "steps=8", "checkpoint_every=4", "eval.final_episodes=1",
                   "eval.max_steps=10")
    assert "2 processes (DDP)" in out
    assert "DDP: parameters identical on 2 processes" in out
    runs = list((tmp_path / "hopper-medium" / "primal+dt").iterdir())
    assert len(runs) == 1  # only rank 0 writes
    ck = dt_checkpoint.load(runs[0])
    assert ck.step == 8 and ck.config["batch_size"] == 8
    assert len(ck.training.rng) == 2  # each process's random streams, for an exact resume
    assert not any(k.startswith("module.") for k in ck.model)  # the bare model, loadable without DDP


def test_a_diverging_ddp_run_stops_every_process_with_its_error_line_and_status_1(hopper_file, tmp_path):
    """A DDP process that fails leaves without the interpreter's finalization (where gloo's threads can abort
    it), so its ``error:`` line is printed by the package itself: it must still be there, with status 1."""
    out = torchrun(hopper_file, tmp_path, "steps=50", "lr=1e30", "warmup_steps=0", "grad_clip=0",
                   "eval.final_episodes=0", status=1)
    assert out.count("error: training diverged at step") == 2, out[-3000:]  # one line per process
    assert "exitcode  : 1" in out and "exitcode  : -6" not in out, out[-3000:]


@pytest.mark.slow
def test_ddp_resume_matches_uninterrupted_ddp_run(hopper_file, tmp_path):
    torchrun(hopper_file, tmp_path / "a", "steps=6", "eval.final_episodes=0")
    (first,) = (tmp_path / "a" / "hopper-medium" / "primal+dt").iterdir()
    torchrun(hopper_file, tmp_path / "a", f"resume={first}", "steps=12", "eval.final_episodes=0")
    torchrun(hopper_file, tmp_path / "b", "steps=12", "eval.final_episodes=0")
    (straight,) = (tmp_path / "b" / "hopper-medium" / "primal+dt").iterdir()
    a, b = dt_checkpoint.load(first), dt_checkpoint.load(straight)
    assert a.step == b.step == 12
    assert all(torch.equal(a.model[k], b.model[k]) for k in b.model)
