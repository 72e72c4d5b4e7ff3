"""python -m primal_dt.train with compile=compile (torch.compile's inductor, slow to compile on a CPU):
the run learns what the eager run learns, resumes exactly, and stops at the first failed step with its
last good checkpoint, as the eager step does (agents.train_step's tests hold the step itself)."""

from pathlib import Path

import pytest
import torch

from agents import dt_checkpoint
from primal_dt.train import Diverged, run

pytestmark = pytest.mark.slow


def weights(summary) -> dict:
    return dt_checkpoint.load(summary["run_dir"]).model


def test_a_compiled_run_matches_the_eager_one_and_resumes_exactly(hopper_file, tmp_path, tiny_train):
    common = tiny_train.args(hopper_file, tmp_path, "steps=8", "log_every=2", "checkpoint_every=4", *tiny_train.QUIET)
    eager = run(common + ["out=" + str(tmp_path / "eager")])
    straight = run(common + ["compile=compile", "out=" + str(tmp_path / "straight")])
    losses = tiny_train.scalars(straight["run_dir"], "loss/total")
    assert [s for s, _ in losses] == [2, 4, 6, 8]
    assert [v for _, v in losses] == pytest.approx([v for _, v in tiny_train.scalars(eager["run_dir"], "loss/total")],
                                                   rel=1e-4)
    a, b = weights(straight), weights(eager)
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in b)
    # stopped at step 4 and resumed (compiled again): the same weights as the run that went straight on
    half = run(tiny_train.args(hopper_file, tmp_path, "steps=4", "log_every=2", "checkpoint_every=4",
                               *tiny_train.QUIET, "compile=compile", "out=" + str(tmp_path / "half")))
    resumed = run(["resume=" + half["run_dir"], "steps=8", "progress=false", "threads=1"])
    c = weights(resumed)
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert tiny_train.scalars(resumed["run_dir"], "loss/total") == losses


def test_a_compiled_run_stops_at_the_first_failed_step_with_the_last_good_checkpoint(hopper_file, tmp_path,
                                                                                      tiny_train):
    with pytest.raises(Diverged, match="diverged at step") as err:
        run(tiny_train.args(hopper_file, tmp_path, "steps=50", "lr=1e30", "warmup_steps=0", "grad_clip=0",
                            "checkpoint_every=1", "compile=compile", *tiny_train.QUIET))
    (last,) = (tmp_path / "hopper-medium" / "primal+dt").glob("*/last.pt")
    ck = dt_checkpoint.load(last)
    assert 1 <= ck.step < 50 and f"diverged at step {ck.step + 1}:" in str(err.value)
    assert all(torch.isfinite(v).all() for v in ck.model.values() if v.is_floating_point())
