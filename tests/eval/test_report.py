"""eval.report on real (tiny) training runs: grouping over seeds, the statistics against their
formulas (scores and the held-out validation MSE), runs kept apart when their configs differ, runs
without validation (older ones) reported with a blank cell, unfinished runs left out, files and plots."""

import csv
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from eval import report
from primal_dt.train import run as train

ROOT = Path(__file__).resolve().parents[2]
TINY = ["preset=smoke", "progress=false", "tensorboard=false", "threads=1", "model.d_model=32", "model.n_heads=2",
        "model.n_layers=2", "model.s=8", "K=5", "batch_size=8", "warmup_steps=3", "steps=6", "eval.every=3",
        "eval.episodes=1", "eval.final_episodes=2", "eval.max_steps=15", "eval.num_envs=2", "eval.engine=stream"]


def tiny_run(hopper_file, out, *extra):
    return train([*TINY, f"data_source=d4rl:{hopper_file}", f"out={out}", *extra])


@pytest.fixture(scope="module")
def runs(hopper_file, tmp_path_factory):
    """dt and primal+dt with seeds 0 and 1, one dt run with another lr, and one unfinished run."""
    root = tmp_path_factory.mktemp("runs")
    summaries = {}
    for model in ("dt", "primal+dt"):
        for seed in (0, 1):
            summaries[(model, seed)] = tiny_run(hopper_file, root, f"model={model}", f"seed={seed}")
    summaries[("dt-lr", 0)] = tiny_run(hopper_file, root, "model=dt", "seed=2", "lr=0.0005")
    unfinished = tiny_run(hopper_file, root, "model=dt", "seed=3", "lr=0.0005")
    (Path(unfinished["run_dir"]) / "summary.json").unlink()  # as a run killed after its last checkpoint
    return root, summaries, Path(unfinished["run_dir"])


def test_table_is_mean_std_and_t_interval_over_seeds(runs, tmp_path):
    root, summaries, unfinished = runs
    res = report.report([str(root)], tmp_path / "rep")
    assert res["runs"] == 5 and res["groups"] == 3
    assert res["unfinished"] == [str(unfinished)]
    for target in ("target3600", "target1800"):
        rows = {r["model"]: r for r in res["rows"][target]}
        vals = [summaries[("primal+dt", s)]["final"][target]["normalized_mean"] for s in (0, 1)]
        row = rows["primal+dt"]
        assert row["seeds"] == 2 and row["steps"] == "6" and row["dataset"] == "hopper-medium"
        assert row["mean"] == pytest.approx(sum(vals) / 2)
        sd = math.sqrt(sum((v - sum(vals) / 2) ** 2 for v in vals))  # n - 1 = 1
        assert row["std"] == pytest.approx(sd)
        assert row["ci95"] == pytest.approx(12.706 * sd / math.sqrt(2), rel=1e-3)  # t_{0.975, 1}
        assert row["paper"] == 74.5  # configs/dt/hopper-medium.yaml's paper: mapping
        # CSV holds the same numbers
        with (tmp_path / "rep" / f"scores-{target}.csv").open() as f:
            csv_rows = {r["model"]: r for r in csv.DictReader(f)}
        assert float(csv_rows["primal+dt"]["mean"]) == pytest.approx(row["mean"])


def test_validation_mse_is_beside_the_scores_as_mean_and_t_interval_over_seeds(runs, tmp_path):
    root, summaries, _ = runs
    res = report.report([str(root)], tmp_path / "rep")
    md = Path(res["markdown"]).read_text()
    vals = [summaries[("primal+dt", s)]["validation"]["action_mse"] for s in (0, 1)]
    assert all(v > 0 for v in vals) and vals[0] != vals[1]  # two seeds, two held-out splits and models
    mean, sd = sum(vals) / 2, math.sqrt(sum((v - sum(vals) / 2) ** 2 for v in vals))
    for target in ("target3600", "target1800"):
        rows = {r["model"]: r for r in res["rows"][target]}
        row = rows["primal+dt"]
        assert row["val_seeds"] == 2
        assert row["val_mse"] == pytest.approx(mean) and row["val_mse_std"] == pytest.approx(sd)
        assert row["val_mse_ci95"] == pytest.approx(12.706 * sd / math.sqrt(2), rel=1e-3)
        one = rows["dt (lr=0.0005)"]  # one seed: its own value, no interval
        assert one["val_seeds"] == 1 and one["val_mse"] == summaries[("dt-lr", 0)]["validation"]["action_mse"]
        assert math.isnan(one["val_mse_ci95"])
        with (tmp_path / "rep" / f"scores-{target}.csv").open() as f:
            csv_rows = {r["model"]: r for r in csv.DictReader(f)}
        assert float(csv_rows["primal+dt"]["val_mse"]) == pytest.approx(mean)
        assert float(csv_rows["primal+dt"]["val_mse_ci95"]) == pytest.approx(row["val_mse_ci95"])
        assert csv_rows["primal+dt"]["val_seeds"] == "2"
        # the markdown row: the scores' cells, then the validation cell
        line = next(x for x in md.split(f"target {target.removeprefix('target')}")[1].splitlines()
                    if x.startswith("| hopper-medium | primal+dt |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[4] == f"{row['mean']:.1f}" and cells[8] == f"{mean:.3g} +- {row['val_mse_ci95']:.2g}"
    assert md.count("| paper | val action MSE |") == 2


def as_older_run(run_dir: Path, dest: Path, how: str) -> Path:
    """A copy of a real run whose summary.json has no validation: ``missing`` as written before
    validation existed, ``null`` as a run trained with val_fraction=0 writes it."""
    shutil.copytree(run_dir, dest)
    summary = json.loads((dest / "summary.json").read_text())
    if how == "missing":
        del summary["validation"]
    else:
        summary["validation"] = None
    (dest / "summary.json").write_text(json.dumps(summary))
    return dest


def test_runs_without_validation_leave_the_cell_blank_or_are_counted_out(runs, tmp_path):
    _, summaries, _ = runs
    old = tmp_path / "old"
    for seed, how in ((0, "missing"), (1, "null")):
        as_older_run(Path(summaries[("dt", seed)]["run_dir"]), old / f"dt-{seed}", how)
    mixed = as_older_run(Path(summaries[("primal+dt", 0)]["run_dir"]), old / "primal+dt-0", "missing")
    res = report.report([str(old), summaries[("primal+dt", 1)]["run_dir"]], tmp_path / "rep")
    rows = {r["model"]: r for r in res["rows"]["target3600"]}
    assert set(rows) == {"dt", "primal+dt"} and res["runs"] == 4
    blank = rows["dt"]  # no run of the group has one: blank, the scores as before
    assert blank["seeds"] == 2 and blank["val_seeds"] == 0 and blank["val_mse"] is None
    assert blank["mean"] == pytest.approx(statistics.fmean(
        summaries[("dt", s)]["final"]["target3600"]["normalized_mean"] for s in (0, 1)))
    part = rows["primal+dt"]  # one seed of two has one: its value, and the count
    assert part["seeds"] == 2 and part["val_seeds"] == 1 and mixed.exists()
    assert part["val_mse"] == summaries[("primal+dt", 1)]["validation"]["action_mse"]
    md = Path(res["markdown"]).read_text()
    assert "| dt | 2 | 6 |" in md and next(x for x in md.splitlines() if "| dt | 2 |" in x).endswith("|  |")
    assert f"| {part['val_mse']:.3g} (1 of 2 seeds) |" in md
    with (tmp_path / "rep" / "scores-target3600.csv").open() as f:
        csv_rows = {r["model"]: r for r in csv.DictReader(f)}
    assert csv_rows["dt"]["val_mse"] == csv_rows["dt"]["val_mse_ci95"] == "" and csv_rows["dt"]["val_seeds"] == "0"
    assert float(csv_rows["dt"]["mean"]) == pytest.approx(blank["mean"])


def test_runs_differing_in_config_are_not_averaged_and_the_report_says_why(runs, tmp_path):
    root, summaries, _ = runs
    res = report.report([str(root)], tmp_path / "rep")
    models = sorted(r["model"] for r in res["rows"]["target3600"])
    assert models == ["dt (lr=0.0005)", "dt (lr=0.001)", "primal+dt"]
    assert len(res["notes"]) == 1 and "lr (0.0005 vs 0.001)" in res["notes"][0]
    single = next(r for r in res["rows"]["target3600"] if r["seeds"] == 1)
    assert single["mean"] == pytest.approx(summaries[("dt-lr", 0)]["final"]["target3600"]["normalized_mean"])
    assert math.isnan(single["ci95"])  # one seed: no interval, and the table says so
    md = Path(res["markdown"]).read_text()
    assert "(1 seed)" in md and "not averaged together" in md and "left out (unfinished" in md


def test_plots_are_written_and_readable(runs, tmp_path):
    root, _, _ = runs
    res = report.report([str(root / "hopper-medium" / "primal+dt")], tmp_path / "rep")
    for png in (res["curves"], res["bars"]):
        img = mpimg.imread(png)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300
        assert img.std() > 0.01  # not a blank canvas
    # the curve of each group has the periodic evaluation (step 3) and the final one (step 6)
    loaded = [report.load_run(Path(d)) for d in res["rows"]["target3600"][0]["runs"]]
    steps, mean, std = report._band(loaded, "target3600")
    assert steps == [3, 6] and len(mean) == len(std) == 2
    assert mean[1] == pytest.approx(statistics.fmean(r.final["target3600"]["normalized_mean"] for r in loaded))


def test_command_line_and_clear_errors(runs, tmp_path):
    root, _, _ = runs
    p = subprocess.run([sys.executable, "-m", "eval.report", str(root / "hopper-medium" / "*"), f"out={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "| hopper-medium | primal+dt | 2 | 6 |" in p.stdout
    assert (tmp_path / "scores.md").exists() and (tmp_path / "curves.png").exists()
    p = subprocess.run([sys.executable, "-m", "eval.report", str(tmp_path / "nothing-here")], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "no such file or directory" in p.stderr and "Traceback" not in p.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    p = subprocess.run([sys.executable, "-m", "eval.report", str(empty)], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "no finished run" in p.stderr
    p = subprocess.run([sys.executable, "-m", "eval.report", str(root), "colour=red"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "--colour" in p.stderr and "Traceback" not in p.stderr  # tyro's error
