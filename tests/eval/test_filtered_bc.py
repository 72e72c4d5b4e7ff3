"""Filtered behaviour cloning (``data_top_fraction``) as a user runs it: a sweep on both replicas shipped with the
package puts it beside dt as a baseline of its own, named in its run directory, summary, checkpoint and report
row; a bad fraction is one error line before anything is written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents import dt_checkpoint, train_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ["tensorboard=false", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "K=5", "batch_size=8",
        "warmup_steps=3", "eval.every=0", "eval.final_episodes=2", "eval.max_steps=15", "eval.num_envs=2",
        "data_source=replica"]


def command(module, *args, tmp_path, timeout=600):
    env = {**os.environ, "PRIMAL_DT_DATA_DIR": str(tmp_path / "no-local-replicas"), "PRIMAL_DT_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_the_label_names_the_fraction_and_one_is_every_episode():
    cfg = train_config.build(["model=bc", "data_top_fraction=0.1"]).cfg
    assert train_config.model_label(cfg) == "bc-top10%"
    assert train_config.model_label(train_config.build(["model=dt", "data_top_fraction=0.25"]).cfg) == "dt-top25%"
    assert train_config.model_label(train_config.build(["model=bc"]).cfg) == "bc"


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.1", "nan"])
def test_a_bad_fraction_is_one_error_line_and_nothing_is_written(tmp_path, bad):
    out = tmp_path / "runs"
    p = command("primal_dt.train", "model=bc", f"data_top_fraction={bad}", "steps=2", f"out={out}", *TINY,
                tmp_path=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"error: data_top_fraction must be in (0, 1], got {float(bad)}"
    assert not out.exists()


def test_a_sweep_reports_filtered_bc_beside_dt_on_both_replicas(tmp_path):
    out = tmp_path / "sweep"
    p = command("eval.sweep", "env=hopper-medium,hopper-medium-replay", "model=dt,bc:data_top_fraction=0.1",
                "seeds=0", "steps=4", "jobs=1", *TINY, f"out={out}", tmp_path=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "4 runs: 4 to start" in p.stdout
    for env in ("hopper-medium", "hopper-medium-replay"):
        run = next((out / env / "bc-top10%").glob("*-seed0"))
        assert json.loads((run / "summary.json").read_text())["model"] == "bc-top10%"
        config = dt_checkpoint.load(run).config
        assert config["data_top_fraction"] == 0.1 and config["model"]["name"] == "bc"
        log = (out / "sweep-logs" / f"{env}-bc-top10%-seed0.log").read_text()
        assert "segments drawn from the" in log and "training episodes of highest return (data_top_fraction=0.1)" in log
        for model in ("dt", "bc-top10%"):
            assert f"| {env} | replica | {model} | recompute | 1 | 4 |" in p.stdout  # its own row, replica data
    report = (out / "report" / "scores.md").read_text()
    assert report.count("| bc-top10% |") == 2 * 2  # both envs, both targets
    rows = (out / "report" / "scores-target3600.csv").read_text()
    assert "hopper-medium-replay,replica,bc-top10%,recompute,1" in rows

    again = command("eval.sweep", "env=hopper-medium,hopper-medium-replay", "model=dt,bc:data_top_fraction=0.1",
                    "seeds=0", "steps=4", *TINY, f"out={out}", tmp_path=tmp_path)
    assert "4 runs: 0 to start, 0 to resume, 4 finished" in again.stdout  # the filtered runs are found again


def test_a_model_named_twice_with_the_same_fraction_is_refused(tmp_path):
    p = command("eval.sweep", "model=bc:data_top_fraction=0.1,bc:data_top_fraction=0.10", "steps=4", *TINY,
                f"out={tmp_path / 'sweep'}", tmp_path=tmp_path)
    assert p.returncode == 2 and "are the same run (bc-top10%)" in p.stderr.strip().splitlines()[-1], p.stderr
    assert not (tmp_path / "sweep").exists()
