"""eval.bench.train runs every model (ours and transformers') and reports ratios measured in one run."""

import json

import pytest

from eval.bench.train import main


def test_benchmark_reports_every_model_and_the_ratios(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "bench.json"
    res = main(["--sizes", "original", "--batch", "2", "--K", "4", "--rounds", "1", "--steps", "1", "--warmup", "0",
                "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(res))
    (r,) = res["results"]
    assert set(r["models"]) == {"ours:dt", "ours:primal+dt", "ours:primalformer-dt", "hf:DecisionTransformerModel"}
    assert all(m["ms_per_step"] > 0 and m["tokens_per_s"] > 0 for m in r["models"].values())
    hf, ours = r["models"]["hf:DecisionTransformerModel"]["params"], r["models"]["ours:dt"]["params"]
    assert abs(hf - ours) / ours < 0.05  # the same architecture size, so the timing comparison is fair
    assert set(r["ratios"]) >= {"primal+dt / dt (time)", "hf / ours dt (time; > 1: ours faster)"}


def test_every_numeric_option_is_valid_or_named(fuzz_options):
    from eval.bench.train import parse_args

    fuzz_options(parse_args, {f"--{k}": "int" for k in ("batch", "K", "steps", "rounds", "warmup", "threads")},
                 base=["--no-hf"], examples=60)
