"""Smoke test of ``python -m eval.bench.inference`` on a tiny checkpoint: every measurement and
ratio lands in the report (no timing is asserted)."""

import json

import pytest


@pytest.mark.slow
def test_inference_bench_reports_every_comparison(tmp_path, tiny_dt, dt_checkpoint_file):
    pytest.importorskip("transformers")
    from eval.bench import inference

    ck = dt_checkpoint_file(tmp_path, tiny_dt("primal+dt", K=4))
    out = tmp_path / "bench.json"
    rep = inference.main([f"checkpoint={ck}", "batches=1,3", "contexts=4,8", "ts=2,5", "calls=2", "rounds=1",
                          "episodes=3", "max_steps=20", f"json={out}"])
    assert json.loads(out.read_text())["latency"].keys() == rep["latency"].keys()
    for key in ("K4_B1", "K4_B3", "K8_B1", "K8_B3"):
        r = rep["latency"][key]
        assert {"stream_ms", "recompute_ms", "hf_recompute_ms", "hf_over_stream"} <= set(r)
    assert {"t2_ms", "t5_ms"} <= set(rep["latency"]["stream_vs_t_B1"])
    ev = rep["evaluation"]
    assert ev["episodes"] == 3 and ev["speedup"] > 0
    assert set(ev["vectorized_by_layout_s"]) == set(ev["speedup_by_layout"]) == {"lanes=2 process", "lanes=2 thread",
                                                                                  "lanes=1"}
    only_eval = inference.main([f"checkpoint={ck}", "latency=false", "lane_layouts=false", "episodes=2",
                                "max_steps=10", "hf=false"])
    assert only_eval["latency"] == {} and set(only_eval["evaluation"]["vectorized_by_layout_s"]) == {"lanes=2 process"}


def test_every_numeric_option_is_valid_or_named(fuzz_options):
    from eval.bench import inference
    from primal_dt.cli import parse

    fuzz_options(lambda argv: inference.check(parse(inference.BenchConfig, argv)),
                 {"calls": "int", "rounds": "int", "episodes": "int", "seq_episodes": "int", "max_steps": "int",
                  "threads": "int", "seed": "int", "batches": "ints", "contexts": "ints", "ts": "ints"}, examples=80)


def test_bad_options_end_with_one_line_before_any_work(run_cli, one_line_error, tmp_path):
    p = run_cli("eval.bench.inference", "batches=1,-3", f"checkpoint={tmp_path / 'absent.pt'}")
    one_line_error(p, "batches must hold numbers that are >= 1, got 1, -3")
