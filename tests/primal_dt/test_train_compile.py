"""python -m primal_dt.train with compile=compile (torch.compile's inductor, slow to compile on a CPU):
the run resumes exactly and stops at the first failed step with its last good checkpoint, as the eager
step does (agents.train_step's tests compare the step itself with the eager one)."""

import pytest
import torch

from agents import dt_checkpoint
from primal_dt.train import Diverged, run

pytestmark = pytest.mark.slow


def weights(summary) -> dict:
    return dt_checkpoint.load(summary["run_dir"]).model


def test_a_compiled_run_resumes_exactly(hopper_file, tmp_path, tiny_train):
    """Dropout on: the compiled step draws its masks from its own stream (so its losses are not the eager
    run's, which agents.train_step's tests compare without dropout), seeded from the run's torch
    generator, which the checkpoint restores."""
    common = tiny_train.args(hopper_file, tmp_path, "log_every=2", "checkpoint_every=4", "compile=compile",
                             *tiny_train.QUIET)
    straight = run(common + ["steps=8", "out=" + str(tmp_path / "straight")])
    losses = tiny_train.scalars(straight["run_dir"], "loss/total")
    assert [s for s, _ in losses] == [2, 4, 6, 8] and losses[-1][1] < losses[0][1]
    half = run(common + ["steps=4", "out=" + str(tmp_path / "half")])
    resumed = run(["resume=" + half["run_dir"], "steps=8", "progress=false", "threads=1"])
    a, c = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert tiny_train.scalars(resumed["run_dir"], "loss/total") == losses


def test_a_compiled_run_stops_at_the_first_failed_step_with_the_last_good_checkpoint(hopper_file, tmp_path,
                                                                                      tiny_train):
    with pytest.raises(Diverged, match="diverged at step") as err:
        # (lr 1e4, as the eager test: a larger one makes step-1 weights the reader refuses as a diverged run's)
        run(tiny_train.args(hopper_file, tmp_path, "steps=50", "lr=1e4", "warmup_steps=0", "grad_clip=0",
                            "checkpoint_every=1", "compile=compile", *tiny_train.QUIET))
    (last,) = (tmp_path / "hopper-medium" / "primal+dt").glob("*/last.pt")
    ck = dt_checkpoint.load(last)
    assert 1 <= ck.step < 50 and f"diverged at step {ck.step + 1}:" in str(err.value)
    assert all(torch.isfinite(v).all() for v in ck.model.values() if v.is_floating_point())
