"""eval.bench.train runs every model (ours and transformers') and reports ratios measured in one run."""

import json

import pytest
import torch

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


def test_stream_exact_training_is_timed_beside_each_standard_step():
    """--stream_window W times each model trained stream-exact (every layer windowed, the loss on exact steps)."""
    from eval.bench.train import SIZES, Ours
    from agents.stream_training import layer_windows

    res = main(["--sizes", "original", "--batch", "2", "--K", "8", "--rounds", "1", "--steps", "1", "--warmup", "0",
                "--no-hf", "--stream_window", "3"])
    (r,) = res["results"]
    assert {"ours:dt[w=3]", "ours:primal+dt[w=3]", "ours:primalformer-dt[w=3]"} <= set(r["models"])
    assert "dt[w=3] / dt (time; stream-exact / standard)" in r["ratios"]
    exact = Ours("primal+dt", SIZES["original"], 8, window=3)
    assert layer_windows(exact.model) == [3, 3, 3] and exact.first == 2  # reach 6 tokens: steps 0-1 not counted


def test_bf16_autocast_is_timed_beside_each_float32_step(capsys):
    """--amp off bf16 times each model's step in bf16 autocast (amp=bf16 of training) against its float32 one,
    the measurement behind the CPU recipe's amp=auto; float32 must be among them, as the reference."""
    from eval.bench.train import SIZES, Ours

    res = main(["--sizes", "original", "--batch", "2", "--K", "4", "--rounds", "1", "--steps", "1", "--warmup", "0",
                "--no-hf", "--amp", "off", "bf16"])
    (r,) = res["results"]
    assert {"ours:dt[bf16]", "ours:primal+dt[bf16]", "ours:primalformer-dt[bf16]"} <= set(r["models"])
    assert "primal+dt[bf16] / primal+dt (time; bf16 autocast / float32)" in r["ratios"]
    assert Ours("dt", SIZES["original"], 4, autocast=torch.bfloat16).stepper.autocast is torch.bfloat16
    assert "== Training step: our DT models (batch 2," in capsys.readouterr().out  # no HuggingFace timed, none named
    with pytest.raises(SystemExit):
        main(["--no-hf", "--amp", "bf16"])
    assert "--amp must include off" in capsys.readouterr().err
