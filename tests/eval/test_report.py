"""eval.report on real (tiny) training runs: grouping over seeds, the statistics against their
formulas (scores and the held-out validation MSE), runs kept apart when their configs differ, runs
without validation (older ones) reported with a blank cell, unfinished runs left out, files and plots."""

import csv
import dataclasses
import json
import os
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import h5py
import matplotlib.image as mpimg
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents import train_config
from envs import sources
from eval import report
from primal_dt.train import run as train

ROOT = Path(__file__).resolve().parents[2]
TINY = ["preset=smoke", "progress=false", "tensorboard=false", "threads=1", "model.d_model=32", "model.n_heads=2",
        "model.n_layers=2", "model.s=8", "K=5", "batch_size=8", "warmup_steps=3", "steps=6", "eval.every=3",
        "eval.episodes=1", "eval.final_episodes=2", "eval.max_steps=15", "eval.num_envs=2", "eval.engine=stream"]


def tiny_run(hopper_file, out, *extra):
    source = [f"data_source=d4rl:{hopper_file}"] if hopper_file else []
    return train([*TINY, *source, f"out={out}", *extra])


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
                    if x.startswith("| hopper-medium | D4RL | primal+dt |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[3] == "stream (not trained)" and cells[7] == f"{row['mean']:.1f} +- {row['ci95']:.1f}"
        assert cells[9] == f"{row['data_level']:.1f}" and cells[11] == f"{mean:.3g} +- {row['val_mse_ci95']:.2g}"
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
    assert "| D4RL | dt | stream (not trained) | 2 | 6 |" in md and re.search(r"\|  \| [\d.]+ \|  \|$", next(x for x in md.splitlines() if "| dt | stream (not trained) | 2 |" in x))
    assert f"| {part['val_mse']:.3g} (1 of 2 seeds) |" in md
    with (tmp_path / "rep" / "scores-target3600.csv").open() as f:
        csv_rows = {r["model"]: r for r in csv.DictReader(f)}
    assert csv_rows["dt"]["val_mse"] == csv_rows["dt"]["val_mse_ci95"] == "" and csv_rows["dt"]["val_seeds"] == "0"
    assert float(csv_rows["dt"]["mean"]) == pytest.approx(blank["mean"])


def test_best_during_training_and_episode_counts_come_from_the_runs_logged_evaluations(runs, tmp_path):
    """CORL's "best": each run's highest evaluation (the periodic ones the checkpoint logged, and the
    final one), averaged over seeds; the episode counts are those of the final and periodic evaluations."""
    _, summaries, _ = runs
    res = report.report([summaries[("primal+dt", s)]["run_dir"] for s in (0, 1)], tmp_path / "rep")
    for target in ("target3600", "target1800"):
        (row,) = res["rows"][target]
        bests = []
        for s in (0, 1):
            run = report.load_run(Path(summaries[("primal+dt", s)]["run_dir"]))
            logged = [v for _, v in run.curves[target]]
            assert len(logged) == 2 and logged[-1] == summaries[("primal+dt", s)]["final"][target]["normalized_mean"]
            bests.append(max(logged))
        assert row["best"] == pytest.approx(statistics.fmean(bests)) and row["best"] >= row["mean"]
        assert row["best_ci95"] == pytest.approx(12.706 * statistics.stdev(bests) / math.sqrt(2), rel=1e-3)
        assert row["episodes"] == "2" and row["eval_episodes"] == "1"  # eval.final_episodes=2, eval.episodes=1
    md = Path(res["markdown"]).read_text()
    assert "| 2 / 1 |" in md and f"| {row['best']:.1f} +- {row['best_ci95']:.1f} |" in md


def test_replica_data_is_its_own_group_and_never_beside_a_paper_number_unmarked(runs, tmp_path, hopper_file):
    """A run on the bundled replica is reported under its data source, apart from the D4RL-file runs,
    and its paper cell says the paper's number is on D4RL data."""
    root, summaries, _ = runs
    replica = tiny_run(None, tmp_path / "replica", "model=primal+dt", "seed=0", "data_source=replica")
    assert replica["data_source"].startswith("replica:")
    res = report.report([summaries[("primal+dt", 0)]["run_dir"], replica["run_dir"]], tmp_path / "rep")
    rows = {r["data"]: r for r in res["rows"]["target3600"]}
    assert set(rows) == {"D4RL", "replica"} and rows["replica"]["seeds"] == rows["D4RL"]["seeds"] == 1
    assert rows["replica"]["model"] == "primal+dt (data=replica)" and "data (D4RL vs replica)" in res["notes"][0]
    md = Path(res["markdown"]).read_text()
    assert "| 74.5 (on D4RL data, not replica) |" in md
    d4rl_line = next(x for x in md.splitlines() if x.startswith("| hopper-medium | D4RL |"))
    assert "| 74.5 |" in d4rl_line
    assert sources.label("minari:mujoco/hopper/medium-v0") == "Minari mujoco/hopper/medium-v0"
    # the level each row is measured against: the mean normalized return of its own data's episodes,
    # here recomputed from the files with h5py (episodes end at a terminal or a timeout)
    for row, path in ((rows["replica"], replica["data_source"].removeprefix("replica:")), (rows["D4RL"], hopper_file)):
        with h5py.File(path, "r") as f:
            rewards, ends = f["rewards"][:], np.flatnonzero(f["terminals"][:] | f["timeouts"][:])
        returns = [seg.sum() for seg in np.split(rewards, ends[:-1] + 1)]
        expected = statistics.fmean(100 * (r + 20.272305) / (3234.3 + 20.272305) for r in returns)
        assert row["data_level"] == pytest.approx(expected, rel=1e-6)
        assert f"| {row['data_level']:.1f} |" in next(x for x in md.splitlines() if f"| {row['data']} |" in x)
    assert report.data_level("hopper-medium", "d4rl:/nowhere/x.hdf5") is None  # not readable here: blank


def test_runs_differing_in_config_are_not_averaged_and_the_report_says_why(runs, tmp_path):
    root, summaries, _ = runs
    res = report.report([str(root)], tmp_path / "rep")
    models = sorted(r["model"] for r in res["rows"]["target3600"])
    assert models == ["dt (lr=0.0005)", "dt (lr=0.001)", "primal+dt"]
    differ = [n for n in res["notes"] if "not averaged together" in n]  # the others: its capped episodes
    assert len(differ) == 1 and "lr (0.0005 vs 0.001)" in differ[0]
    single = next(r for r in res["rows"]["target3600"] if r["seeds"] == 1)
    assert single["mean"] == pytest.approx(summaries[("dt-lr", 0)]["final"]["target3600"]["normalized_mean"])
    assert math.isnan(single["ci95"])  # one seed: no interval, and the table says so
    md = Path(res["markdown"]).read_text()
    assert "(1 seed)" in md and "not averaged together" in md and "left out (unfinished" in md


def test_a_group_trained_in_bf16_is_named_so(tmp_path, hopper_file):
    """Precision changes scores (primal+dt did not train in bf16 on a GPU): a bf16 group's report says so."""
    run = tiny_run(hopper_file, tmp_path / "bf16", "model=dt", "seed=0", "amp=bf16")
    res = report.report([run["run_dir"]], tmp_path / "rep")
    assert "hopper-medium dt: trained in bf16 autocast (amp=bf16), not float32" in res["notes"]
    assert "trained in bf16 autocast" in Path(res["markdown"]).read_text()


def test_plots_are_written_and_readable(runs, tmp_path):
    root, _, _ = runs
    res = report.report([str(root / "hopper-medium" / "primal+dt")], tmp_path / "rep")
    for png in (res["curves"], res["bars"]):
        img = mpimg.imread(png)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300
        assert img.std() > 0.01  # not a blank canvas
    # the curve of each group has the periodic evaluation (step 3) and the final one (step 6)
    loaded = [report.load_run(Path(d)) for d in res["rows"]["target3600"][0]["runs"]]
    steps, mean, half = report._band(loaded, "target3600")
    assert steps == [3, 6] and len(mean) == len(half) == 2
    finals = [r.final["target3600"]["normalized_mean"] for r in loaded]
    assert mean[1] == pytest.approx(statistics.fmean(finals))
    assert half[1] == pytest.approx(12.706 * statistics.stdev(finals) / math.sqrt(2), rel=1e-3)  # 95 % band


def test_plots_keep_the_data_level_off_the_frame_and_mark_capped_evaluations(runs, tmp_path):
    """The data's level was drawn on the plot's top edge when it bounded the curves, and a capped evaluation
    (eval.max_steps=15 here) stood unmarked beside the paper's number: now both are visible on the plots."""
    root, _, _ = runs
    loaded = [report.load_run(d) for d in report.find_runs([str(root / "hopper-medium" / "dt")])[0]]
    groups, _ = report.group_runs([r for r in loaded if r.config["lr"] != 0.0005])
    (g,) = groups
    level = g.runs[0].data_level
    ax = report.curves_figure(groups, ["target3600"]).axes[0]
    lo, hi = ax.get_ylim()
    assert lo + 1.0 <= level <= hi - 1.0  # inside, with room to spare
    (curve,) = [t.get_text() for t in ax.get_legend().get_texts() if "seed" in t.get_text()]
    assert curve.endswith(", episodes capped at 15 steps")
    rows = report.score_rows(groups, "target3600")
    bars = report.bars_figure({"target3600": rows}, {(g.env, g.model, g.engine): report.cap(g)}).axes[0]
    assert [t.get_text().splitlines()[-1] for t in bars.get_xticklabels()] == ["capped at 15 steps"]
    assert [p.get_hatch() for p in bars.patches] == ["//"]
    assert "ours, episodes capped: not the paper's protocol" in [t.get_text() for t in bars.get_legend().get_texts()]
    whole = dataclasses.replace(g, runs=[dataclasses.replace(r, config={**r.config, "eval": {**r.config["eval"],
                                                                                            "max_steps": 0}})
                                         for r in g.runs])
    assert report.cap(whole) is None
    plain = report.bars_figure({"target3600": rows}, {}).axes[0]
    assert [p.get_hatch() for p in plain.patches] == [None] and "capped" not in plain.get_xticklabels()[0].get_text()


def test_command_line_and_clear_errors(runs, tmp_path):
    root, _, _ = runs
    p = subprocess.run([sys.executable, "-m", "eval.report", str(root / "hopper-medium" / "*"), f"out={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "| hopper-medium | D4RL | primal+dt | stream (not trained) | 2 | 6 |" in p.stdout
    assert "evaluation episodes capped at 15 steps (eval.max_steps; the simulator's limit is 1000)" in p.stdout
    assert (tmp_path / "scores.md").exists() and (tmp_path / "curves.png").exists()
    p = subprocess.run([sys.executable, "-m", "eval.report", str(tmp_path / "nothing-here")], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "no such file or directory" in p.stderr and "Traceback" not in p.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    p = subprocess.run([sys.executable, "-m", "eval.report", str(empty)], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "no finished run" in p.stderr
    p = subprocess.run([sys.executable, "-m", "eval.report"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})  # a new user's first try: no argument
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("error: no runs given: name run directories, directories of runs, "
                                                 "globs of either or a report's runs.json, e.g. python -m eval.report "
                                                 "runs/sweep")
    p = subprocess.run([sys.executable, "-m", "eval.report", str(root), "colour=red"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "--colour" in p.stderr and "Traceback" not in p.stderr  # tyro's error


# -- summaries that are not what training writes ----------------------------------------------------------------
def with_summary(run_dir: Path, dest: Path, text: str) -> Path:
    """A copy of a real run whose summary.json holds ``text``."""
    shutil.copytree(run_dir, dest)
    (dest / "summary.json").write_text(text)
    return dest


def edited(summary: dict, **changes) -> str:
    return json.dumps({k: v for k, v in {**summary, **changes}.items() if v is not ...})


BAD = {  # name: (summary.json text from a real one, what the line says)
    "no-env": (lambda s: edited(s, env=...), "no 'env'"),
    "final-list": (lambda s: edited(s, final=[1, 2]), "final must be an object of target -> scores, or null, got a list"),
    "string-score": (lambda s: edited(s, final={"target3600": {**s["final"]["target3600"], "normalized_mean": "high"}}),
                     "final.target3600.normalized_mean must be a number, got a string"),
    "null": (lambda s: "null", "the file must be a JSON object (a run's summary), got null"),
    "list": (lambda s: "[1, 2]", "the file must be a JSON object (a run's summary), got a list"),
    "seed-string": (lambda s: edited(s, seed="0"), "seed must be an integer, got a string"),
    "invalid-json": (lambda s: '{"env": "hopper', "is not valid JSON"),
}


def test_bad_summaries_are_skipped_with_a_line_naming_them(runs, tmp_path):
    _, summaries, _ = runs
    good = summaries[("dt", 0)]
    base = json.loads((Path(good["run_dir"]) / "summary.json").read_text())
    root = tmp_path / "runs"
    for name, (text, _) in BAD.items():
        with_summary(Path(good["run_dir"]), root / name, text(base))
    shutil.copytree(good["run_dir"], root / "good")
    p = subprocess.run([sys.executable, "-m", "eval.report", str(root), f"out={tmp_path / 'rep'}"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == len(BAD)
    for name, (_, why) in BAD.items():
        line = next(x for x in lines if f"{root / name / 'summary.json'}" in x)
        assert line.startswith("skipped: ") and why in line, line
    assert "# Report: 1 runs in 1 groups" in p.stdout and p.stdout.count("left out (unreadable)") == len(BAD)


def test_nan_and_inf_scores_are_flagged_not_averaged(runs, tmp_path):
    _, summaries, _ = runs
    root = tmp_path / "runs"
    for seed, score in ((0, float("nan")), (1, float("inf"))):
        s = summaries[("primal+dt", seed)]
        d = shutil.copytree(s["run_dir"], root / f"s{seed}")
        broken = json.loads((d / "summary.json").read_text())
        broken["final"]["target3600"]["normalized_mean"] = score
        (d / "summary.json").write_text(json.dumps(broken))
    ok = shutil.copytree(summaries[("primal+dt", 0)]["run_dir"], root / "ok")
    res = report.report([str(root)], tmp_path / "rep")
    (row,) = res["rows"]["target3600"]
    assert row["seeds"] == 1 and row["mean"] == summaries[("primal+dt", 0)]["final"]["target3600"]["normalized_mean"]
    assert any(f"{root / 's0'}: final score for target3600 is nan, not averaged" in n for n in res["notes"])
    assert any(f"{root / 's1'}: final score for target3600 is inf, not averaged" in n for n in res["notes"])
    assert "not averaged" in Path(res["markdown"]).read_text() and ok.exists()
    assert {r["seeds"] for r in res["rows"]["target1800"]} == {3}  # the other target's scores are all finite


SCALARS = st.none() | st.booleans() | st.integers(-5, 10**9) | st.floats(allow_nan=True) | st.text(max_size=5)
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=12), c, max_size=3),
                    max_leaves=8)
FIELDS = ["env", "model", "seed", "steps", "final", "validation", "engine"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=3), drop=st.sets(st.sampled_from(FIELDS), max_size=2),
       scores=st.dictionaries(st.sampled_from(["normalized_mean", "return_mean", "length_mean"]), JSON, max_size=2),
       whole=st.none() | JSON)
def test_any_summary_is_reported_or_is_one_named_error(runs, tmp_path_factory, edits, drop, scores, whole):
    """Whatever summary.json holds, a run is either read into numbers the report can average (or flag), or
    refused with a ValueError naming the file."""
    _, summaries, _ = runs
    d = tmp_path_factory.getbasetemp() / "property-run"
    if not d.exists():
        shutil.copytree(summaries[("dt", 0)]["run_dir"], d)
    base = dict(summaries[("dt", 0)])
    base["final"] = {"target3600": {**base["final"]["target3600"], **scores}}
    text = json.dumps(whole if whole is not None else {k: v for k, v in {**base, **edits}.items() if k not in drop})
    (d / "summary.json").write_text(text)
    try:
        r = report.load_run(d)
    except ValueError as err:
        assert str(d) in str(err)
        return
    assert isinstance(r.env, str) and isinstance(r.seed, int) and isinstance(r.steps, int)
    for scores_ in r.final.values():
        assert isinstance(scores_["normalized_mean"], (int, float)) and not isinstance(scores_["normalized_mean"], bool)
    assert r.val_mse is None or isinstance(r.val_mse, float)
    assert r.engine.split(" ")[0] in train_config.ENGINES  # a row is labelled by an engine there is
    report.score_rows(report.group_runs([r])[0], "target3600")  # numbers, or left out when NaN/inf


# -- writes that fail -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_report_that_cannot_be_written_is_one_line_and_leaves_no_partial_file(runs, tmp_path, run_cli,
                                                                             one_line_error):
    root, _, _ = runs
    out = tmp_path / "rep"
    p = run_cli("eval.report", str(root / "hopper-medium" / "primal+dt"), f"out={out}", file_size=20_000)
    one_line_error(p, f"could not write the report's learning curves {out / 'curves.png'}: file too large", status=1)
    assert (out / "scores.md").exists() and not (out / "curves.png").exists()
    assert not list(out.glob(".*.tmp"))  # no half-written file either
    (tmp_path / "file").write_text("x")
    p = run_cli("eval.report", str(root / "hopper-medium" / "primal+dt"), f"out={tmp_path / 'file' / 'rep'}")
    one_line_error(p, f"could not write the report directory (nothing was written) {tmp_path / 'file' / 'rep'}: "
                      "a part of the path is a file", status=1)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    p = run_cli("eval.report", str(root / "hopper-medium" / "primal+dt"), f"out={locked / 'rep'}",
                honour_permissions=True)
    one_line_error(p, f"could not write the report directory (nothing was written) {locked / 'rep'}: permission denied", status=1)


def hopper_v5_episodes(n=16, max_steps=60, seed=0):
    """Episodes of a noisy open-loop policy in Hopper-v5, in Minari's layout (T+1 observations)."""
    import gymnasium as gym
    import numpy as np

    env, rng, out = gym.make("Hopper-v5"), np.random.default_rng(seed), []
    for e in range(n):
        obs, _ = env.reset(seed=seed + e)
        bias, cols = rng.uniform(-0.5, 0.5, 3), {"observations": [obs], "actions": [], "rewards": [],
                                                "terminations": [], "truncations": []}
        for t in range(max_steps):
            act = np.clip(bias + 0.3 * rng.standard_normal(3), -1, 1).astype(np.float32)
            obs, rew, term, trunc, _ = env.step(act)
            trunc = trunc or (not term and t == max_steps - 1)
            for k, v in zip(("observations", "actions", "rewards", "terminations", "truncations"),
                            (obs, act, rew, term, trunc)):
                cols[k].append(v)
            if term or trunc:
                break
        out.append({k: np.asarray(v) for k, v in cols.items()} | {"seed": seed + e})
    env.close()
    return out


def test_a_minari_dataset_id_trains_rolls_out_and_is_reported_as_minari(tmp_path, monkeypatch):
    """env=mujoco/hopper/medium-v0 with a local Minari dataset (written here with minari's own writer):
    trained and evaluated in Hopper-v5, rolled out from its checkpoint, normalized with the dataset's
    reference scores, and reported under its data source with no unmarked paper number."""
    from envs import get_spec
    from envs.minari_source import write_minari
    from eval.rollout import run as rollout

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    monkeypatch.setenv("PRIMAL_DT_OFFLINE", "1")
    write_minari("mujoco/hopper/medium-v0", hopper_v5_episodes(), "Hopper-v5", ref_min_score=-20.0, ref_max_score=3980.0)
    summary = tiny_run(None, tmp_path / "runs", "env=mujoco/hopper/medium-v0", "model=dt", "seed=0")
    assert summary["data_source"] == "minari:mujoco/hopper/medium-v0" and summary["env"] == "mujoco/hopper/medium-v0"
    final = summary["final"]["target3600"]
    assert final["normalized_mean"] == pytest.approx(100 * (final["return_mean"] + 20.0) / 4000.0)
    rolled = rollout([f"checkpoint={summary['run_dir']}", "episodes=2", "max_steps=15", "num_envs=2", "progress=false"])
    assert rolled["gym_id"] == "Hopper-v5" and rolled["reference_scores"]["expert"] == 3980.0
    assert "Minari dataset's metadata" in rolled["reference_scores"]["source"]
    assert get_spec("mujoco/hopper/medium-v0").ref_max == 3980.0
    res = report.report([summary["run_dir"]], tmp_path / "rep")
    rows = res["rows"]["target3600"]  # the training's own final evaluation (stream) and the rollout's (recompute)
    assert sorted(r["engine"] for r in rows) == ["recompute", "stream (not trained)"]
    row = rows[0]
    assert row["dataset"] == "mujoco/hopper/medium-v0" and row["data"] == "Minari mujoco/hopper/medium-v0"
    md = Path(res["markdown"]).read_text()
    assert "(on D4RL data, not Minari mujoco/hopper/medium-v0)" in md  # hopper-medium's paper number, marked


@pytest.mark.slow  # a real report process; the reader's own tests (tests/primal_dt/test_json_reader.py) are the cheap guard
def test_hostile_summaries_neither_hang_nor_break_the_table(runs, tmp_path):
    """A summary.json that is a FIFO (which would block a reader forever), a link to /dev/zero, one with a
    300-digit score, and a model name holding ``|`` and a line break: the first three are skipped with a
    line each, the last is reported in one intact table row."""
    _, summaries, _ = runs
    good = Path(summaries[("dt", 0)]["run_dir"])
    base = json.loads((good / "summary.json").read_text())
    root = tmp_path / "runs"
    for name in ("fifo", "zero"):
        d = shutil.copytree(good, root / name)
        (d / "summary.json").unlink()
        os.mkfifo(d / "summary.json") if name == "fifo" else (d / "summary.json").symlink_to("/dev/zero")
    score = {**base["final"]["target3600"], "normalized_mean": 1e308}
    with_summary(good, root / "huge", edited(base, final={**base["final"], "target3600": score}))
    with_summary(good, root / "named", edited(base, model="dt|x\nnext"))
    p = subprocess.run([sys.executable, "-m", "eval.report", str(root), f"out={tmp_path / 'rep'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 3 and all(x.startswith("skipped: ") for x in lines), lines
    assert any("fifo/summary.json is not a regular file" in x for x in lines)
    assert any("zero/summary.json is not a regular file" in x for x in lines)
    assert any("huge/summary.json holds the number 1e+308" in x for x in lines)
    table = (tmp_path / "rep" / "scores.md").read_text()
    rows = [x for x in table.splitlines() if x.startswith("| ") and "dt\\|x next" in x]  # a row per target
    headers = [x for x in table.splitlines() if x.startswith("| dataset")]
    cells = lambda line: re.split(r"(?<!\\)\|", line)  # noqa: E731 - an escaped \| is no cell border
    assert len(rows) == len(headers) >= 1 and {len(cells(r)) for r in rows} == {len(cells(headers[0]))}


def test_the_engine_column_keeps_every_policy_apart_and_names_the_window():
    from agents.stream_training import Fidelity
    from eval.report import engine_label

    labels = [engine_label(Fidelity(e, w)) for e, w in
              [("recompute", 0), ("recompute", 10), ("stream", 0), ("stream", 10), ("stream", 4)]]
    assert labels == ["recompute", "recompute", "stream (not trained)", "stream (exact, window 10)",
                      "stream (exact, window 4)"]


def _rollout_report(run_dir: Path, name: str, engine: str, score: float, max_steps: int, step: int, age: int):
    """A rollout report as eval.rollout writes it (the fields eval.report reads), ``age`` seconds old."""
    path = run_dir / name
    path.write_text(json.dumps({"engine": engine, "train_step": step, "max_steps": max_steps, "episodes_per_target": 2,
                                "targets": {"3600": {"normalized_mean": score}}}))
    t = path.stat().st_mtime - age
    os.utime(path, (t, t))


def test_two_rollouts_of_one_checkpoint_are_not_two_seeds_and_each_is_capped_at_its_own_max_steps(runs, tmp_path):
    """A second rollout-stream-2.json of the same checkpoint is one run evaluated twice: the newest stands for
    the engine, the other is named and left out (averaged, it made a "2 seeds" row with a confidence interval);
    a rollout's cap note is its own max_steps, not the training's eval.max_steps."""
    _, summaries, _ = runs
    run = tmp_path / "run"
    shutil.copytree(summaries[("dt", 0)]["run_dir"], run)
    steps = json.loads((run / "summary.json").read_text())["steps"]
    _rollout_report(run, "rollout-recompute.json", "recompute", 10.0, 1000, steps, age=100)
    _rollout_report(run, "rollout-recompute-2.json", "recompute", 30.0, 7, steps, age=0)
    res = report.report([str(run)], tmp_path / "rep")
    rows = [r for r in res["rows"]["target3600"] if r["engine"] == "recompute"]
    assert [(r["seeds"], r["mean"]) for r in rows] == [(1, 30.0)]
    assert any("rollout-recompute.json: an earlier evaluation by recompute" in n and "not seeds" in n
               for n in res["notes"])
    assert any("(recompute): evaluation episodes capped at 7 steps" in n for n in res["notes"])


def test_a_rollout_report_copied_beside_another_run_is_left_out(runs, tmp_path, hopper_file):
    """Runs of one recipe stop at the same step, so a rollout report copied (or left) beside another run passed the
    step check and scored that run; the report names the checkpoint it evaluated by its SHA-256."""
    from eval import rollout

    _, summaries, _ = runs
    mine, other = tmp_path / "mine", tmp_path / "other"
    shutil.copytree(summaries[("dt", 0)]["run_dir"], mine)
    shutil.copytree(summaries[("dt", 1)]["run_dir"], other)
    rollout.run([f"checkpoint={mine}", "engine=recompute", "episodes=1", "max_steps=15", "num_envs=1",
                 "targets=3600", "progress=false", f"data_source=d4rl:{hopper_file}"])
    shutil.copy(mine / "rollout-recompute.json", other / "rollout-recompute.json")
    res = report.report([str(mine), str(other)], tmp_path / "rep")
    (row,) = [r for r in res["rows"]["target3600"] if r["engine"] == "recompute"]
    assert row["seeds"] == 1 and row["runs"] == [str(mine)]
    assert any(f"{other / 'rollout-recompute.json'}: an evaluation of another checkpoint" in n for n in res["notes"])


def test_a_run_resumed_after_its_summary_is_left_out_not_reported_with_its_old_scores(runs, tmp_path):
    """A finished run resumed for more steps and stopped holds a checkpoint past its summary: its summary's scores
    are not the checkpoint's (nor its config's step budget), so the run is named as unfinished and left out."""
    import torch

    _, summaries, _ = runs
    run = tmp_path / "run"
    shutil.copytree(summaries[("dt", 0)]["run_dir"], run)
    ck = torch.load(run / "last.pt", weights_only=True)
    ck["step"] += 5
    torch.save(ck, run / "last.pt")
    shutil.copytree(summaries[("dt", 1)]["run_dir"], tmp_path / "other")
    res = report.report([str(run), str(tmp_path / "other")], tmp_path / "rep")
    assert res["runs"] == 1 and len(res["skipped"]) == 1
    assert f"its checkpoint is at step {ck['step']} but its summary.json at step {ck['step'] - 5}" in res["skipped"][0]
    assert f"resume={run}" in res["skipped"][0]


def test_learning_curves_of_two_engines_are_told_apart_in_the_legend(runs, tmp_path, monkeypatch):
    """Runs alike but for eval.engine (a run-time option) are two groups, one per engine; their curves were drawn
    side by side under the same legend entry ("dt, replica data, 1 seed" twice)."""
    _, summaries, _ = runs
    for name in ("a", "b"):
        shutil.copytree(summaries[("dt", 0)]["run_dir"], tmp_path / name)
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    (tmp_path / "b" / "summary.json").write_text(json.dumps({**summary, "engine": "recompute"}))
    figures = {}
    real = report.save_figure
    monkeypatch.setattr(report, "save_figure", lambda fig, path, what: figures.setdefault(Path(path).name, fig) and
                        real(fig, path, what))
    res = report.report([str(tmp_path / "a"), str(tmp_path / "b")], tmp_path / "rep")
    engines = sorted(r["engine"] for r in res["rows"]["target3600"])
    assert len(engines) == 2 and "recompute" in engines
    labels = [t.get_text() for t in figures["curves.png"].axes[0].get_legend().get_texts()]
    assert sorted(e for e in engines if any(f", {e}, " in label for label in labels)) == engines


def same(a, b) -> bool:
    """Equal, a NaN (one seed's interval) equal to a NaN."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_the_reports_runs_json_remakes_and_grows_the_tables_after_the_run_directories_are_gone(runs, tmp_path):
    """A sweep's checkpoints stay on the machine that trained them; the report's runs.json is what is kept. From it
    alone the tables come out the same (rollout rows included); with a new run beside it, the new seed is averaged
    with the archived ones; a run given both ways counts once; a damaged archive is one line naming the record."""
    _, summaries, _ = runs
    old, new = tmp_path / "old", tmp_path / "new"
    for d, key in ((old, ("dt", 0)), (old, ("primal+dt", 0)), (new, ("primal+dt", 1))):
        shutil.copytree(summaries[key]["run_dir"], d / key[0])
    steps = json.loads((old / "dt" / "summary.json").read_text())["steps"]
    _rollout_report(old / "dt", "rollout-recompute.json", "recompute", 12.5, 15, steps, age=0)
    first = report.report([str(old)], tmp_path / "rep1")
    assert first["archive"] == tmp_path / "rep1" / "runs.json"
    shutil.rmtree(old)

    again = report.report([str(tmp_path / "rep1" / "runs.json")], tmp_path / "rep2")
    assert same(again["rows"], first["rows"]) and again["runs"] == first["runs"] == 3
    assert [r["mean"] for r in again["rows"]["target3600"] if r["engine"] == "recompute"] == [12.5]  # the rollout
    for t in ("target3600", "target1800"):
        assert (tmp_path / "rep2" / f"scores-{t}.csv").read_bytes() == (tmp_path / "rep1" / f"scores-{t}.csv").read_bytes()
    assert any("rep1/runs.json: 3 evaluations of 2 runs read from it" in n for n in again["notes"])

    grown = report.report([str(tmp_path / "rep2" / "runs.json"), str(new)], tmp_path / "rep3")
    row = next(r for r in grown["rows"]["target3600"] if r["model"] == "primal+dt")
    vals = [summaries[("primal+dt", s)]["final"]["target3600"]["normalized_mean"] for s in (0, 1)]
    assert row["seeds"] == 2 and row["mean"] == pytest.approx(statistics.fmean(vals))
    twice = report.report([str(tmp_path / "rep3" / "runs.json"), str(new)], tmp_path / "rep4")
    assert same(twice["rows"], grown["rows"])  # the directory's run replaces its archived copy, not a third seed

    archive = tmp_path / "rep4" / "runs.json"
    doc = json.loads(archive.read_text())
    doc["runs"][1]["final"] = {"target3600": {"normalized_mean": "high"}}
    archive.write_text(json.dumps(doc))
    p = subprocess.run([sys.executable, "-m", "eval.report", str(archive), f"out={tmp_path / 'rep5'}"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"{archive}: run 1 cannot be read" in p.stderr and "make it again from the run directories" in p.stderr
    archive.write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match="not a runs.json that eval.report wrote"):
        report.report([str(archive)], tmp_path / "rep6")


def test_the_weights_moving_average_is_evaluated_by_rollout_and_reported_as_its_own_row(runs, tmp_path, capsys):
    """``eval.rollout weights=ema`` scores the checkpoint's moving average (rollout-<engine>-ema.json, its weights
    named); the report sets it beside the run's own final evaluation, never averaged with it."""
    from eval import rollout

    _, summaries, _ = runs
    run = tmp_path / "run"
    shutil.copytree(summaries[("dt", 0)]["run_dir"], run)
    rollout.main([f"checkpoint={run}", "weights=ema", "engine=stream", "episodes=2", "num_envs=2", "max_steps=15",
                  "progress=false"])
    assert "engine=stream (NOT the trained policy), weights=ema (the weights' moving average)" in capsys.readouterr().out
    rep = json.loads((run / "rollout-stream-ema.json").read_text())
    assert rep["weights"] == "ema" and rep["train_step"] == 6
    res = report.report([str(run)], tmp_path / "rep")
    rows = {r["engine"]: r for r in res["rows"]["target3600"]}
    assert set(rows) == {"stream (not trained)", "stream (not trained), EMA 0.999"}
    assert rows["stream (not trained), EMA 0.999"]["mean"] == pytest.approx(rep["targets"]["3600"]["normalized_mean"])
    assert rows["stream (not trained)"]["mean"] == pytest.approx(
        json.loads((run / "summary.json").read_text())["final"]["target3600"]["normalized_mean"])


def test_the_default_trainings_criterion_is_computed_from_the_table_by_its_formula(tmp_path):
    """``against_protocol``: each stream-exact arm against recompute's mean, 95 % interval (Student's t) and standard
    error over seeds, the SE condition only where the protocol's mean beats the data's level by more than its SE;
    the weights' moving average beside the last weights, judged narrower and not lower (or not); the training's cost
    per 1,000 steps averaged."""
    config = dataclasses.asdict(train_config.TrainConfig())
    runs = []
    arms = {"recompute": [40.0, 42.0, 38.0, 44.0, 36.0], "stream (exact, window 21)": [39.0, 41.0, 38.0, 40.0, 37.0],
            "stream (exact, window 10)": [37.0, 38.0, 36.0, 39.0, 35.0],
            "recompute, EMA 0.999": [41.0, 41.5, 40.5],  # 3 of the 5 runs' averages evaluated
            "recompute, lr cosine to 0.1": [42.0, 43.0, 41.0, 42.0, 42.0],
            "stream (exact, whole episodes)": [50.0, 52.0, 49.0, 51.0, 48.0]}  # above the protocol's interval
    for env, level in (("hopper-medium-replay", 16.6), ("hopper-medium", 39.5)):
        for engine, scores in arms.items():
            for seed, score in enumerate(scores):
                runs.append(report.Run(tmp_path / env / f"seed{seed}", env, "primal+dt", seed, 7000, config,
                                       {"target3600": {"normalized_mean": score, "episodes": 50}}, {}, "replica",
                                       0.1, level, engine, s_per_1k=100.0 + seed))
    (tmp_path / "runs.json").write_text(report.archive(runs))
    res = report.report([str(tmp_path / "runs.json")], tmp_path / "rep")
    proto = arms["recompute"]
    mean, se = statistics.fmean(proto), statistics.stdev(proto) / math.sqrt(5)
    ci = 2.776 * statistics.stdev(proto) / math.sqrt(5)
    got = {(c["dataset"], c["arm"]): c for c in res["decisions"]["target3600"]}
    assert set(got) == {(e, a) for e in ("hopper-medium-replay", "hopper-medium") for a in [*list(arms)[1:3], list(arms)[5]]}
    for (env, arm), c in got.items():
        m = statistics.fmean(arms[arm])
        assert c["protocol_mean"] == pytest.approx(mean) and c["protocol_ci95"] == pytest.approx(ci, rel=1e-3)
        assert c["protocol_se"] == pytest.approx(se) and c["separates"] is (env == "hopper-medium-replay")
        # inside the interval or above it (no cost), and within one SE below where the dataset separates policies
        assert c["passes"] is (m >= mean - ci and (env == "hopper-medium" or m >= mean - se))
        assert c["above"] is (m > mean + ci)
        # Welch's standard error of the difference of the two means, from both arms' seeds
        assert c["difference"] == pytest.approx(m - mean)
        assert c["difference_se"] == pytest.approx(math.sqrt(se ** 2 + statistics.variance(arms[arm]) / 5))
    assert got[("hopper-medium-replay", "stream (exact, whole episodes)")]["above"]
    assert got[("hopper-medium-replay", "stream (exact, whole episodes)")]["passes"]
    assert got[("hopper-medium-replay", "stream (exact, window 21)")]["passes"]
    assert not got[("hopper-medium-replay", "stream (exact, window 10)")]["passes"]  # 3 below, SE 1.4
    assert got[("hopper-medium", "stream (exact, window 10)")]["passes"]  # that dataset does not separate policies
    md = (tmp_path / "rep" / "scores.md").read_text()
    # window 10: 37.0 against 40.0, SEs 0.71 and 1.41 -> -3.0 (1.6)
    assert ("| hopper-medium-replay | replica | primal+dt | stream (exact, window 10) | 5 | 37.0 | 40.0 +- 3.9 (SE 1.4, 5) "
            "| -3.0 (1.6) | yes | yes | **no** | **no** |") in md
    assert ("| hopper-medium-replay | replica | primal+dt | stream (exact, whole episodes) | 5 | 50.0 | 40.0 +- 3.9 (SE 1.4, "
            "5) | +10.0 (1.6) | above | yes | yes | yes |") in md
    assert ("- primal+dt, stream (exact, window 21): meets the criterion on every dataset compared (hopper-medium: "
            "5 seeds against the protocol's 5, hopper-medium-replay: 5 seeds against the protocol's 5)") in md
    assert "- primal+dt, stream (exact, window 10): does not meet it (fails on hopper-medium-replay;" in md
    # an arm that passes replay but has no hopper-medium runs, where the protocol has an interval: undecided
    only_replay = [r for r in runs if not (r.env == "hopper-medium" and r.engine == "stream (exact, window 21)")]
    (tmp_path / "replay-only").mkdir()
    (tmp_path / "replay-only" / "runs.json").write_text(report.archive(only_replay))
    report.report([str(tmp_path / "replay-only" / "runs.json")], tmp_path / "rep-replay")
    assert ("- primal+dt, stream (exact, window 21): passes every dataset compared (hopper-medium-replay: 5 seeds "
            "against the protocol's 5), not compared on hopper-medium, where the arm has no run yet: undecided"
            ) in (tmp_path / "rep-replay" / "scores.md").read_text()
    # nor when the arm ran there but the protocol has one seed there: no interval to compare with
    one_protocol_seed = [r for r in runs if not (r.env == "hopper-medium" and r.engine == "recompute" and r.seed)]
    (tmp_path / "one-seed").mkdir()
    (tmp_path / "one-seed" / "runs.json").write_text(report.archive(one_protocol_seed))
    report.report([str(tmp_path / "one-seed" / "runs.json")], tmp_path / "rep-one")
    assert ("- primal+dt, stream (exact, window 21): passes every dataset compared (hopper-medium-replay: 5 seeds "
            "against the protocol's 5), not compared on hopper-medium, where the protocol has 1 seed (an interval "
            "needs 2): undecided") in (tmp_path / "rep-one" / "scores.md").read_text()
    # an arm of one seed: its difference has no standard error
    single = [r for r in runs if r.env == "hopper-medium-replay" and (r.engine == "recompute" or (
        r.engine == "stream (exact, window 21)" and r.seed == 0))]
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "runs.json").write_text(report.archive(single))
    one = report.report([str(tmp_path / "single" / "runs.json")], tmp_path / "rep-single")
    assert math.isnan(one["decisions"]["target3600"][0]["difference_se"])
    assert "| 39.0 | 40.0 +- 3.9 (SE 1.4, 5) | -1.0 | yes |" in (tmp_path / "rep-single" / "scores.md").read_text()
    # the last weights of the same 3 runs (40, 42, 38: t = 4.303), not of all 5
    assert "| hopper-medium | replica | primal+dt | recompute, EMA 0.999 | 3 | 41.0 +- 1.2 | 40.0 +- 5.0 | yes |" in md
    assert "| hopper-medium | replica | primal+dt | recompute, lr cosine to 0.1 | 5 | 42.0 +- 0.9 | 40.0 +- 3.9 | yes |" in md
    assert "- moving average: narrower and not lower in 2 of the 2 rows of 2 or more seeds" in md
    assert all(r["s_per_1k"] == pytest.approx(100.0 + (r["seeds"] - 1) / 2) for r in res["rows"]["target3600"])
    assert "| 102.0 |" in md
    again = report.report([str(tmp_path / "rep" / "runs.json")], tmp_path / "again")  # the cost survives runs.json
    assert [r["s_per_1k"] for r in again["rows"]["target3600"]] == [r["s_per_1k"] for r in res["rows"]["target3600"]]


@pytest.mark.parametrize("lever, base, verdict", [
    ((41.0, 1.0, 3), (40.0, 5.0, 3), True),  # narrower, higher
    ((40.0, 1.0, 3), (40.0, 5.0, 3), True),  # narrower, same mean
    ((39.9, 1.0, 3), (40.0, 5.0, 3), False),  # narrower but lower
    ((45.0, 6.0, 3), (40.0, 5.0, 3), False),  # higher but wider
    ((45.0, 0.0, 1), (40.0, 5.0, 3), None),  # one seed: no interval to compare
    ((45.0, 1.0, 3), None, None),  # nothing to compare with
])
def test_a_lever_is_judged_by_its_interval_and_its_mean(lever, base, verdict):
    """The issue's test of the moving average and of a falling rate: narrower interval and a mean not lower."""
    row = lambda m, ci, n: {"mean": m, "ci95": ci, "seeds": n}  # noqa: E731
    assert report.better_than(row(*lever), base and row(*base)) is verdict


def test_a_stream_window_run_that_counted_segment_tails_is_a_training_of_its_own():
    """Before ``stream_counts`` a stream_window run counted its segments' tails (an episode's first steps rarely):
    its rows say so, apart from the protocol-counting runs of the same window, whatever else the training changed."""
    old = {"stream_window": 21}  # a config written before the option
    assert report.training_label(old) == report.training_label({**old, "stream_counts": "tail"}) == ", segment tails"
    assert report.training_label({**old, "stream_counts": "protocol"}) == ""
    assert report.training_label({"stream_window": 0}) == report.training_label({}) == ""
    both = {**old, "lr_schedule": "cosine", "lr_min": 0.2}
    assert report.training_label(both) == ", segment tails, lr cosine to 0.2"
    cfg = dataclasses.asdict(train_config.TrainConfig(stream_window=21))
    assert report.training_label(cfg) == ""  # what a run now writes


def test_a_runs_json_from_before_stream_counts_names_its_tail_counting_runs(tmp_path):
    """An archive written before the label existed: its stream_window runs counted tails, and now say so (their
    moving average too), while a protocol-counting run of the same window is a row of its own."""
    old = {k: v for k, v in dataclasses.asdict(train_config.TrainConfig(stream_window=21, K=40)).items()
           if k != "stream_counts"}
    new = dataclasses.asdict(train_config.TrainConfig(stream_window=21, K=40))
    runs = [report.Run(tmp_path / f"{c}{seed}", "hopper-medium-replay", "dt", seed, 7000, cfg,
                       {"target3600": {"normalized_mean": 40.0 + seed, "episodes": 50}}, {}, "replica", 0.1, 16.6,
                       engine) for seed in (0, 1) for c, cfg, engine in (
                           ("old", old, "stream (exact, window 21)"), ("ema", old, "stream (exact, window 21), EMA 0.999"),
                           ("new", new, "stream (exact, window 21)"))]
    (tmp_path / "runs.json").write_text(report.archive(runs))
    rows = report.report([str(tmp_path / "runs.json")], tmp_path / "rep")["rows"]["target3600"]
    assert sorted((r["model"], r["engine"], r["seeds"]) for r in rows) == [
        ("dt", "stream (exact, window 21)", 2), ("dt", "stream (exact, window 21), segment tails", 2),
        ("dt", "stream (exact, window 21), segment tails, EMA 0.999", 2)]


def test_a_runs_wall_time_counts_each_process_that_trained_it_and_not_the_gap_between(hopper_file, tmp_path):
    """``min / run``: a run trained, stopped, and resumed after a pause is timed over its two processes' event files
    (creation second to last write), without the pause; the table shows it, runs.json keeps it."""
    import time

    t0 = time.time()
    first = tiny_run(hopper_file, tmp_path / "runs", "steps=3", "tensorboard=true")
    t1 = time.time()
    shutil.copytree(first["run_dir"], tmp_path / "after-first")  # (copy2: the files' times kept)
    first_wall = report.wall_seconds(tmp_path / "after-first")
    time.sleep(3)
    t2 = time.time()
    done = train([f"resume={first['run_dir']}", "steps=6", "progress=false"])
    t3 = time.time()
    wall = report.wall_seconds(Path(done["run_dir"]))
    assert 0 < first_wall < wall <= (t1 - t0) + (t3 - t2) + 2  # both processes (whole seconds at a writer's start)
    assert wall < t3 - t0 - 2  # the pause is not counted
    assert report.wall_seconds(tmp_path) is None  # no event files: unknown, not zero
    res = report.report([str(tmp_path / "runs")], tmp_path / "rep")
    (row,) = res["rows"]["target3600"]
    assert row["min_per_run"] == pytest.approx(wall / 60)
    assert f"| {row['min_per_run']:.1f} |" in (tmp_path / "rep" / "scores.md").read_text()
    again = report.report([str(tmp_path / "rep" / "runs.json")], tmp_path / "again")
    assert again["rows"]["target3600"][0]["min_per_run"] == pytest.approx(wall / 60)


def test_the_cost_cells_are_medians_so_one_paused_run_does_not_move_them(tmp_path):
    config = dataclasses.asdict(train_config.TrainConfig())
    runs = [report.Run(tmp_path / f"seed{seed}", "hopper-medium", "dt", seed, 7000, config,
                       {"target3600": {"normalized_mean": 40.0, "episodes": 50}}, {}, "replica", 0.1, 36.1, "recompute",
                       s_per_1k=cost, wall_s=wall) for seed, (cost, wall) in enumerate(((100.0, 900.0), (110.0, 960.0),
                                                                                        (990.0, 7000.0)))]
    (tmp_path / "runs.json").write_text(report.archive(runs))
    (row,) = report.report([str(tmp_path / "runs.json")], tmp_path / "rep")["rows"]["target3600"]
    assert row["s_per_1k"] == 110.0 and row["min_per_run"] == 16.0
