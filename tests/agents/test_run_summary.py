"""``agents.run_summary``: the summary.json a training run leaves is written only when its own reader would take
it, and what the writer built reads back as written (NaN scores included). Whole runs writing and
``eval.report`` reading hostile summaries are tested in tests/eval/test_report.py."""

import json
import math
import re

import pytest

from agents import run_summary, train_config


def rollout_result(normalized: float) -> dict:
    """One target's results as the evaluator returns them (more keys than the summary keeps)."""
    return {"normalized_mean": normalized, "normalized_std": 1.5, "return_mean": 1200.0, "return_std": 30.0,
            "length_mean": 400.0, "returns": [1170.0, 1230.0], "lengths": [390, 410]}


def test_a_built_summary_is_written_and_read_back_as_it_was_built(tmp_path):
    cfg = train_config.build(["preset=smoke", "seed=4", "eval.targets=3600,1.5"]).cfg
    summary = run_summary.build_summary(
        cfg, layers=["primal", "softmax"], steps=20, data_source="d4rl:hopper.hdf5", train_time=3.0, processes=1,
        final={3600.0: rollout_result(41.0), 1.5: rollout_result(math.nan)},
        held=run_summary.Held(0.25, episodes=3, segments=120), run_dir=tmp_path)
    assert (summary["env"], summary["model"], summary["seed"], summary["steps"]) == ("hopper-medium", "primal+dt", 4, 20)
    assert summary["s_per_1k_steps"] == 150.0 and summary["engine"] == cfg.eval.engine
    assert sorted(summary["final"]) == ["target1.5", "target3600"]
    assert summary["final"]["target3600"] == {k: rollout_result(41.0)[k] for k in run_summary.SCORES} | {"episodes": 2}
    assert summary["validation"] == {"action_mse": 0.25, "episodes": 3, "segments": 120,
                                     "val_fraction": cfg.val_fraction}
    path = run_summary.write_summary(summary, tmp_path)
    assert path == tmp_path / "summary.json"
    back = run_summary.read_summary(path)
    assert math.isnan(back["final"]["target1.5"]["normalized_mean"])  # a failed rollout's NaN is kept, not refused
    back["final"]["target1.5"]["normalized_mean"] = summary["final"]["target1.5"]["normalized_mean"] = 0.0
    assert back == json.loads(json.dumps(summary))


def test_a_run_without_final_evaluation_or_validation_says_null(tmp_path):
    cfg = train_config.build(["preset=smoke"]).cfg
    summary = run_summary.build_summary(cfg, layers=["softmax"], steps=0, data_source="d4rl:x", train_time=0.0,
                                        processes=2, final=None, held=None, run_dir=tmp_path)
    assert summary["final"] is None and summary["validation"] is None and "engine" not in summary
    assert run_summary.read_summary(run_summary.write_summary(summary, tmp_path)) == summary


@pytest.mark.parametrize("change, says", [
    ({"seed": -1}, "steps and seed must be >= 0, got 20 and -1"),
    ({"model": ""}, "model must be a non-empty string"),
    ({"final": {"target3600": {"normalized_mean": "41"}}}, "final.target3600.normalized_mean must be a number"),
    ({"final": {"best": {"normalized_mean": 1.0}}}, "final: 'best' is not a target"),
])
def test_the_writer_refuses_what_its_reader_would_and_writes_nothing(tmp_path, change, says):
    cfg = train_config.build(["preset=smoke"]).cfg
    summary = run_summary.build_summary(cfg, layers=["softmax"], steps=20, data_source="d4rl:x", train_time=1.0,
                                        processes=1, final=None, held=None, run_dir=tmp_path) | change
    with pytest.raises(ValueError, match="^the summary training wrote: .*" + re.escape(says)):
        run_summary.write_summary(summary, tmp_path)
    assert list(tmp_path.iterdir()) == []
