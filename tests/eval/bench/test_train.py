"""eval.bench.train runs every model (ours and transformers') and reports ratios measured in one run; its
rehearsal (tiny sizes, the compiled forms on torch.compile's eager backend) times every form and precision on
whatever device is here, and its time budget names what it left out."""

import json

import pytest
import torch

from eval.bench.train import main

REHEARSAL = ["--sizes", "tiny", "--batch", "8", "--K", "5", "--steps", "1", "--rounds", "2", "--warmup", "1",
             "--backend", "eager", "--no-hf", "--threads", "1"]


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
                "--no-hf", "--stream_window", "3", "4:10", "--amp", "off", "bf16"])
    (r,) = res["results"]
    assert {"ours:dt[w=3]", "ours:primal+dt[w=3]", "ours:primalformer-dt[w=3]"} <= set(r["models"])
    assert "dt[w=3] / dt (time)" in r["ratios"]
    # an arm on segments of its own K, in each precision, against the standard step in the same precision
    wide = r["models"]["ours:primal+dt[w=4,K=10,bf16]"]
    assert wide["K"] == 10 and r["models"]["ours:primal+dt[w=4,K=10]"]["K"] == 10 and r["models"]["ours:dt"]["K"] == 8
    assert "primal+dt[w=4,K=10,bf16] / primal+dt[bf16] (time)" in r["ratios"]
    assert "primal+dt[w=3,bf16] / primal+dt[bf16] (time)" in r["ratios"] and "dt[bf16] / dt (time)" in r["ratios"]
    for bad in ("0", "21:", "x:40", "21:0"):
        with pytest.raises(SystemExit) as exit_:
            main(["--sizes", "tiny", "--no-hf", "--stream_window", bad])
        assert exit_.value.code == 2
    exact = Ours("primal+dt", SIZES["original"], 8, window=3)
    assert layer_windows(exact.model) == [3, 3, 3] and exact.first == 2  # reach 6 tokens: steps 0-1 not counted


def test_whole_episode_training_is_timed_beside_each_standard_step():
    """--whole_episodes times each model's step on chunks carrying the stream's state: the state each step ends in
    is the next one's (so the timed work is the carrying one, not a fresh state each time)."""
    from eval.bench.train import SIZES, batches, Ours

    res = main(["--sizes", "original", "--batch", "2", "--K", "4", "--rounds", "1", "--steps", "1", "--warmup", "0",
                "--no-hf", "--whole_episodes"])
    (r,) = res["results"]
    assert {"ours:dt[whole]", "ours:primal+dt[whole]", "ours:primalformer-dt[whole]"} <= set(r["models"])
    assert "primalformer-dt[whole] / primalformer-dt (time)" in r["ratios"]
    runner = Ours("primalformer-dt", dict(SIZES["original"], d_model=16, n_heads=2, s=4), 4, whole=True)
    first, second = batches(2, 2, 4)
    runner.step(first)
    after_one = runner.state
    assert after_one is not None and all(t.abs().sum() > 0 for t in after_one)
    runner.step(second)
    assert not all(torch.equal(a, b) for a, b in zip(after_one, runner.state))


def test_bf16_autocast_is_timed_beside_each_float32_step(capsys):
    """--amp off bf16 times each model's step in bf16 autocast (amp=bf16 of training) against its float32 one,
    the measurement behind the CPU recipe's amp=auto; float32 must be among them, as the reference."""
    from eval.bench.train import SIZES, Ours

    res = main(["--sizes", "original", "--batch", "2", "--K", "4", "--rounds", "1", "--steps", "1", "--warmup", "0",
                "--no-hf", "--amp", "off", "bf16"])
    (r,) = res["results"]
    assert {"ours:dt[bf16]", "ours:primal+dt[bf16]", "ours:primalformer-dt[bf16]"} <= set(r["models"])
    assert "primal+dt[bf16] / primal+dt (time)" in r["ratios"]
    assert Ours("dt", SIZES["original"], 4, autocast=torch.bfloat16).stepper.autocast is torch.bfloat16
    assert "== Training step on cpu: our DT models (batch 2," in capsys.readouterr().out  # no HuggingFace, none named
    with pytest.raises(SystemExit):
        main(["--no-hf", "--amp", "bf16"])
    assert "--amp must include off" in capsys.readouterr().err


def test_the_rehearsal_times_every_form_and_precision_and_prints_the_table_last(tmp_path, run_cli):
    path = tmp_path / "bench.json"
    cuda = torch.cuda.is_available()
    forms = ["eager", "compile"] + ["cudagraphs"] * cuda
    p = run_cli("eval.bench.train", *REHEARSAL, "--device", "cuda" if cuda else "cpu", "--compile", *forms,
                "--amp", "off", "bf16", "--act_calls", "10", "--json", str(path), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(path.read_text())
    (r,) = res["results"]
    suffixes = ["", "[compile]", "[bf16]", "[compile,bf16]"] + ["[cudagraphs]", "[cudagraphs,bf16]"] * cuda
    assert set(r["models"]) == {f"ours:{lay}{v}" for v in suffixes for lay in ("dt", "primal+dt", "primalformer-dt")}
    assert set(res["act_ms"]) == {"act batch 1", "act batch 100"} and res["skipped"] == []
    out = p.stdout.rstrip().splitlines()
    table = out[out.index(next(x for x in out if x.startswith("== Training step on "))):]
    assert any(x.startswith("| tiny (32, 2 heads) | ours:primal+dt[compile,bf16] |") for x in table)
    assert table[-1].startswith("stream agent act (primal+dt): act batch 1 ")


def test_what_the_time_budget_leaves_out_is_named_under_the_table(capsys):
    res = main([*REHEARSAL, "--device", "cpu", "--compile", "eager", "compile", "--budget_s", "0.001",
                "--act_calls", "10"])
    assert set(res["results"][0]["models"]) == {"ours:dt"}  # the first, the reference, always runs
    assert res["skipped"] == ["tiny ours:primal+dt", "tiny ours:primalformer-dt", "tiny ours:dt[compile]",
                              "tiny ours:primal+dt[compile]", "tiny ours:primalformer-dt[compile]", "act latency"]
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "not measured (--budget_s reached): " + ", ".join(
        res["skipped"])


@pytest.mark.parametrize("args,fragment", [
    (["--device", "cuda:7"], "error: --device=cuda:7"),
    (["--device", "cpu", "--compile", "eager", "cudagraphs"], "error: --compile cudagraphs needs a CUDA device"),
])
def test_a_device_or_form_this_machine_lacks_is_one_line(args, fragment, capsys):
    if "cuda:7" in args and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--no-hf"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(fragment), err


def test_the_softmax_implementations_are_timed_beside_the_default_step():
    """--attention_impl times each model with its softmax layers forced to SDPA (or the T x T form) beside the default
    (impl=auto), in each precision, the ratio against the default step of the same precision."""
    from eval.bench.train import SIZES, Ours
    from primal_dt.attention.softmax import SoftmaxAttention

    res = main(["--sizes", "tiny", "--batch", "2", "--K", "4", "--rounds", "1", "--steps", "1", "--warmup", "0",
                "--no-hf", "--attention_impl", "auto", "sdpa", "--amp", "off", "bf16"])
    (r,) = res["results"]
    assert {"ours:dt[sdpa]", "ours:primal+dt[sdpa,bf16]"} <= set(r["models"]) and "ours:dt[auto]" not in r["models"]
    assert "dt[sdpa] / dt (time)" in r["ratios"] and "primal+dt[sdpa,bf16] / primal+dt[bf16] (time)" in r["ratios"]
    impls = lambda runner: {m.impl for m in runner.model.modules() if isinstance(m, SoftmaxAttention)}  # noqa: E731
    assert impls(Ours("dt", SIZES["tiny"], 4, impl="sdpa")) == {"sdpa"}
    assert impls(Ours("dt", SIZES["tiny"], 4)) == {"auto"}
    assert impls(Ours("primal+dt", SIZES["tiny"], 4, impl="materialized", window=3)) == {"materialized"}
