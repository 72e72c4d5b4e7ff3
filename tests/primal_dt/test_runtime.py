"""What every entry point shares (primal_dt.run.errors, options, distributed, outputs, runtime and the
checkpoint finder): bad input as one line, resume paths, the attention_options words, devices, and
the option shorthands of primal_dt.run.cli."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from primal_dt.run import checkpoint, distributed, errors, options, outputs, runtime
from primal_dt.run.errors import SetupError

ROOT = Path(__file__).resolve().parents[2]


# -- errors --------------------------------------------------------------------------------------------
def test_setup_errors_turn_bad_input_into_setup_error_and_keep_the_message():
    with pytest.raises(SetupError, match="K must be >= 1") as err, errors.setup_errors():
        raise ValueError("K must be >= 1, got 0")
    assert isinstance(err.value.__cause__, ValueError)
    with pytest.raises(SetupError, match="no file"), errors.setup_errors():
        raise FileNotFoundError("no file at /x.hdf5")
    with pytest.raises(SetupError, match="needs aeon"), errors.setup_errors(RuntimeError):
        raise RuntimeError("needs aeon")
    with pytest.raises(KeyError), errors.setup_errors():  # not bad input: a bug, which keeps its traceback
        raise KeyError("x")


def test_main_prints_one_line_exit_2_for_bad_input_and_1_for_a_failed_run(capsys):
    class Diverged(RuntimeError):
        pass

    def bad_input(argv):
        raise SetupError(f"unknown option in {argv}")

    def diverges(argv):
        raise Diverged("training diverged at step 3")

    with pytest.raises(SystemExit) as exit_:
        errors.main(bad_input, ["a=1"])
    assert exit_.value.code == 2 and capsys.readouterr().err == "error: unknown option in ['a=1']\n"
    with pytest.raises(SystemExit) as exit_:
        errors.main(diverges, ["a=1"], expected=(Diverged,))
    assert exit_.value.code == "error: training diverged at step 3"  # sys.exit(str): printed, exit status 1

    def interrupted(argv):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        errors.main(interrupted, [])
    assert exit_.value.code == 130

    def bug(argv):
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):  # unexpected errors keep their traceback
        errors.main(bug, [])


@pytest.mark.parametrize("module, argv, message", [
    ("primal_dt.train", ["env=hopper-mediun"], "error: env: unknown"),
    ("primal_dt.classify", ["task=uea/Nope"], "error: unknown task 'uea/Nope'"),
])
def test_entry_points_exit_with_one_line_not_a_traceback(tmp_path, module, argv, message):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", module, *argv, f"out={tmp_path}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not any(tmp_path.iterdir())


# -- resume paths --------------------------------------------------------------------------------------
def find(path):
    """what ``resume=path`` means, as the trainers ask (inside ``errors.setup_errors``)"""
    with errors.setup_errors():
        return checkpoint.find(path, "last.pt", "resume")


def test_resume_takes_a_file_or_its_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "last.pt").write_bytes(b"x")
    (run_dir / "best.pt").write_bytes(b"x")
    assert find(run_dir) == run_dir / "last.pt"
    assert find(run_dir / "best.pt") == run_dir / "best.pt"
    with pytest.raises(SetupError, match=r"resume=.*missing: no checkpoint at .*missing"):
        find(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SetupError, match=r"no checkpoint at .*empty/last.pt, nor in any run under it; give a run"):
        find(empty)


def test_a_directory_of_runs_means_its_newest_run_that_holds_a_checkpoint(tmp_path, capsys):
    """What ``ls -d runs/.../*/ | tail -n 1`` got wrong: the last run listed may hold no checkpoint yet."""
    root = tmp_path / "runs" / "hopper-medium" / "dt"
    old, new, empty = (root / n for n in ("20260101-000000-seed0", "20260102-000000-seed1", "20260103-000000-seed0"))
    for d in (old, new, empty):
        d.mkdir(parents=True)
    (old / "last.pt").write_bytes(b"x")
    (new / "last.pt").write_bytes(b"x")
    os.utime(old / "last.pt", (1_000_000, 1_000_000))
    assert find(tmp_path / "runs") == new / "last.pt"
    assert f"resume={tmp_path / 'runs'}: using the newest run with a last.pt under it, {new}" in capsys.readouterr().err
    os.utime(new / "last.pt", (500_000, 500_000))
    assert find(root) == old / "last.pt"
    assert find(empty.parent.parent) == old / "last.pt"


# -- attention_options ---------------------------------------------------------------------------------
def test_attention_options_words_are_typed_by_the_constructor_and_defaults_fill_only_what_is_unset():
    opts = options.attention_options(("softmax.window=30", "primal.s=4", "primal.data_dependent=true",
                                      "svr-bn.beta=0.25", "performer.n_features=none"), "model.attention_options",
                                     {"primal": {"s": 64, "window": 10}})
    assert opts == {"softmax": {"window": 30}, "primal": {"s": 4, "data_dependent": True, "window": 10},
                    "svr-bn": {"beta": 0.25}, "performer": {"n_features": None}}
    assert type(opts["softmax"]["window"]) is int and type(opts["svr-bn"]["beta"]) is float
    assert options.attention_options((), defaults={"primal": {"s": 8}}) == {"primal": {"s": 8}}
    assert options.attention_options(()) == {}


def test_attention_words_round_trip():
    opts = {"softmax": {"window": 7, "bias": False}, "performer": {"n_features": None}, "primal": {"s": 4}}
    assert options.attention_options(options.attention_words(opts)) == opts
    assert options.as_words("") == () and options.as_words(["a.b=1"]) == ("a.b=1",)
    assert options.as_words("softmax.window=3") == ("softmax.window=3",)


@pytest.mark.parametrize("words, message", [
    (["softmax=3"], "model.attention_options: 'softmax=3' is not mechanism.option=value; write e.g. "
                    "model.attention_options=softmax.window=30"),
    (["softmax.window"], "is not mechanism.option=value"),
    (["softmx.window=3"], "unknown attention mechanism 'softmx'. Did you mean 'softmax'"),
    (["softmax.windw=3"], "attention 'softmax' does not accept option 'windw'. Did you mean 'window'? Accepted: "
                          "window, dropout, bias, impl"),
    (["softmax.window=3.5"], "model.attention_options: softmax.window must be an integer, got '3.5'"),
    (["primal.data_dependent=yes"], "primal.data_dependent must be true or false, got 'yes'"),
    (["svr-bn.beta=big"], "svr-bn.beta must be a number, got 'big'"),
])
def test_attention_options_errors_name_the_option(words, message):
    with pytest.raises(ValueError) as err:
        options.attention_options(words, "model.attention_options")
    assert message in str(err.value)


# -- devices -------------------------------------------------------------------------------------------
def test_device_names_are_checked_and_cpu_is_always_there():
    for ok in ("auto", "cpu", "cuda", "cuda:1"):
        options.check_device(ok)
    for bad in ("gpu", "cuda:x", "cuda1", ""):
        with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
            options.check_device(bad)
    assert runtime.pick_device("cpu") == torch.device("cpu")
    assert runtime.pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SetupError, match="CUDA is not available; use device=cpu"):
            runtime.pick_device("cuda")


def test_one_process_without_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    d = distributed.init_distributed("cpu")
    assert (d.rank, d.world, d.main) == (0, 1, True)
    d.barrier()  # a no-op for one process
    assert distributed.check_replicas(torch.nn.Linear(2, 2), d)


# -- numeric options and failed writes -----------------------------------------------------------------
def test_numbers_outside_their_range_name_the_option_nan_and_inf_never_pass():
    ok = {"K": 5, "lr": 1e-3, "dropout": 0.0, "targets": (3600.0, 1800.0), "step": None}
    rules = {"K": options.AT_LEAST_1, "lr": options.POSITIVE, "dropout": options.FRACTION, "targets": options.ANY,
             "step": options.AT_LEAST_0}
    options.check_numbers(argparse.Namespace(**ok), rules)
    for key, bad, message in (("K", 0, "K must be >= 1, got 0"), ("lr", float("nan"), "lr must be > 0, got nan"),
                              ("lr", float("inf"), "lr must be > 0, got inf"),
                              ("dropout", 1.0, r"dropout must be in \[0, 1\), got 1.0"),
                              ("targets", (3600.0, float("nan")), "targets must hold numbers that are finite, got "
                                                                  "3600.0, nan"),
                              ("K", True, "K must be >= 1, got True")):
        with pytest.raises(ValueError, match=message):
            options.check_numbers(argparse.Namespace(**{**ok, key: bad}), rules)
    assert str(options.SEED) == "in [0, 4294967296)" and str(options.Range(0, 1, low_open=True)) == "in (0, 1]"


def test_new_paths_are_claimed_exclusively_by_concurrent_claimants(tmp_path):
    """Twenty threads asking for the same name at once get twenty different paths, each created."""
    from concurrent.futures import ThreadPoolExecutor

    claim = lambda _: outputs.new_path(outputs.numbered(tmp_path / "report.json"), outputs.create_file)  # noqa: E731
    with ThreadPoolExecutor(20) as pool:
        got = list(pool.map(claim, range(20)))
    assert len(set(got)) == 20 and all(p.exists() for p in got)
    assert {p.name for p in got} == {"report.json", *(f"report-{i}.json" for i in range(2, 21))}
    with pytest.raises(errors.WriteError, match=r"could not write the report .*report.json/x: a part of the path"):
        outputs.new_path(outputs.numbered(tmp_path / "report.json" / "x"), outputs.create_file, what="report")


def test_a_failed_write_is_one_line(capsys):
    def full_disk(argv):
        with errors.writing("/data/last.pt", "checkpoint (step 40)"):
            raise OSError(28, "No space left on device")

    with pytest.raises(SystemExit) as exit_:
        errors.main(full_disk, [])
    assert exit_.value.code == "error: could not write the checkpoint (step 40) /data/last.pt: no space left on the " \
                               "device (disk full)"
    assert errors.main(lambda argv: {"ok": argv}, ["a"]) == {"ok": ["a"]}  # what run returns comes back
