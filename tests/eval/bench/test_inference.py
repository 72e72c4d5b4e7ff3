"""``python -m eval.bench.inference`` run tiny in a real subprocess: every engine, section and ratio lands in
the report, and every ratio is the quotient of the report's own figures (no timing is asserted)."""

import json
import math
import re

import pytest

STREAM_PATHS = ("stream", "onnx", "load_agent", "torchscript")


def exported_available() -> bool:
    try:
        import onnxruntime  # noqa: F401

        import agents.export
        import agents.onnx_policy  # noqa: F401
    except ImportError:
        return False
    return True


def check_latency_entry(e: dict, K: int, B: int, hf: bool) -> None:
    ms = e["ms"]
    assert (e["K"], e["batch"]) == (K, B)
    expected = {"stream", "recompute"} | ({"hf_recompute"} if hf else set())
    if exported_available():
        expected |= {"onnx", "load_agent", "torchscript"}
    assert set(ms) == expected and all(v > 0 for v in ms.values())
    assert e["ratios"], "no ratio printed"
    for name, value in e["ratios"].items():
        slow, fast = name.split("/")
        assert math.isclose(value, ms[slow] / ms[fast], rel_tol=1e-9), name
    if "load_agent" in ms:  # what load_agent's wrapper costs over the bare runtime on its graph
        assert math.isclose(e["ratios"]["load_agent/onnx"], ms["load_agent"] / ms["onnx"], rel_tol=1e-9)
    streams = {p: ms[p] for p in STREAM_PATHS if p in ms}
    assert e["best_stream"] == min(streams, key=streams.get)
    assert {f"recompute/{p}" for p in streams} <= set(e["ratios"])
    if hf:
        assert math.isclose(e["hf_over_best"], ms["hf_recompute"] / min(streams.values()), rel_tol=1e-9)


@pytest.mark.slow
def test_bench_reports_every_engine_section_and_ratio(tmp_path, tiny_dt, dt_checkpoint_file, run_cli):
    pytest.importorskip("transformers")
    ck = dt_checkpoint_file(tmp_path, tiny_dt("primal+dt", K=4, d_model=16, n_heads=2))
    out = tmp_path / "bench.json"
    p = run_cli("eval.bench.inference", f"checkpoint={ck}", "sizes=16x2,8x1", "batches=1,3", "contexts=4,6", "ts=2,3",
                "calls=2", "rounds=1", "episodes=3", "seq_episodes=2", "max_steps=20", f"json={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    # latency: both sizes (the checkpoint's and a random one), every K and batch, every engine
    assert rep["sizes"] == ["16x2", "8x1"] and set(rep["latency"]) == {"16x2", "8x1"}
    for size in ("16x2", "8x1"):
        for K in (4, 6):
            for B in (1, 3):
                check_latency_entry(rep["latency"][size][f"K{K}_B{B}"], K, B, hf=True)
    vs_t = rep["latency"]["16x2"]["stream_vs_t_B1"]
    assert set(vs_t["ms"]) == {"t2", "t3"}
    assert math.isclose(vs_t["max_over_min"], max(vs_t["ms"].values()) / min(vs_t["ms"].values()), rel_tol=1e-9)
    assert exported_available() == (rep["exported"]["formats"] == ["onnx", "torchscript"])
    # evaluation: same run, scaled sequential loop, ratio of the two
    ev = rep["evaluation"]
    assert ev["episodes"] == 3 and ev["sequential_episodes_run"] == 2
    assert math.isclose(ev["speedup"], ev["sequential_recompute_s"] / ev["vectorized_stream_s"], rel_tol=1e-9)
    assert set(ev["vectorized_by_layout_s"]) == set(ev["speedup_by_layout"]) == {"lanes=2 process", "lanes=1"}
    for k, v in ev["speedup_by_layout"].items():
        assert math.isclose(v, ev["sequential_recompute_s"] / ev["vectorized_by_layout_s"][k], rel_tol=1e-9)
    assert ev["env_steps"] == round(ev["stream_mean_length"] * 3)
    # the bench measures, it does not grade
    assert "targets" not in rep and "goal" not in p.stdout


@pytest.mark.slow
def test_evaluation_only_and_latency_only_runs(tmp_path, tiny_dt, dt_checkpoint_file, run_cli):
    ck = dt_checkpoint_file(tmp_path, tiny_dt("primal+dt", K=4, d_model=16, n_heads=2))
    out = tmp_path / "a.json"
    p = run_cli("eval.bench.inference", f"checkpoint={ck}", "latency=false", "lane_layouts=false", "episodes=2",
                "max_steps=10", f"json={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["latency"] == {}
    assert set(rep["evaluation"]["vectorized_by_layout_s"]) == {"lanes=2 process"}
    out = tmp_path / "b.json"
    p = run_cli("eval.bench.inference", f"checkpoint={ck}", "sizes=", "batches=2", "contexts=3", "ts=2", "calls=1",
                "rounds=1", "hf=false", "exported=false", "episodes=0", f"json={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["sizes"] == ["16x2"] and "evaluation" not in rep  # no sizes: the checkpoint's own
    assert "skipping the onnx runtime: exported=false" in p.stdout
    assert set(rep["latency"]["16x2"]["K3_B2"]["ms"]) == {"stream", "recompute"}


def test_every_numeric_option_is_valid_or_named(fuzz_options):
    from eval.bench import inference

    fuzz_options(inference.parse_args,
                 {"calls": "int", "rounds": "int", "episodes": "int", "seq_episodes": "int", "max_steps": "int",
                  "threads": "int", "seed": "int", "batches": "ints", "contexts": "ints", "ts": "ints"}, examples=80)


@pytest.mark.parametrize("size", ["256", "256x0", "100x3", "axb", "-4x2"])
def test_a_bad_size_is_named(size, capsys):
    from eval.bench import inference

    with pytest.raises(SystemExit):
        inference.parse_args([f"sizes=256x4,{size}"])
    assert re.search("error: sizes: .* (is not|needs)", capsys.readouterr().err)


def test_bad_options_end_with_one_line_before_any_work(run_cli, one_line_error, tmp_path):
    p = run_cli("eval.bench.inference", "batches=1,-3", f"checkpoint={tmp_path / 'absent.pt'}")
    one_line_error(p, "batches must hold numbers that are >= 1, got 1, -3")
