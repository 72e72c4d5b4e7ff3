"""``python -m primal_dt.classify`` end to end: real data, real TensorBoard files, clear errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from primal_dt.run import checkpoint
from primal_dt.classify import SetupError, build_config, run

TINY = ["arch.d_model=16", "arch.n_heads=2", "arch.d_ff=32", "progress=false", "threads=1"]


def test_uea_run_writes_events_checkpoints_plot_and_summary(tmp_path):
    argv = ["task=uea/JapaneseVowels-fast", "model=primal+trans", "train.epochs=2", "data.max_train=40",
            "data.max_val=20", "data.max_test=30", f"out={tmp_path}", *TINY]
    summary = run(argv)
    out = tmp_path / summary["run_dir"].split(str(tmp_path) + "/")[1]
    assert summary["protocol"] == "val" and 0 <= summary["test_acc"] <= 1 and summary["steps"] == 6
    assert json.loads((out / "summary.json").read_text())["test_acc"] == summary["test_acc"]
    assert (out / "accuracy.png").stat().st_size > 0
    ck = checkpoint.load(out / "best.pt", expect_kind="classifier")
    assert ck["config"]["model"] == "primal+trans" and ck["config"]["primal"]["s"] == 16  # by_model preset section
    assert checkpoint.load(out / "last.pt", expect_kind="classifier")["step"] == 6

    acc = EventAccumulator(str(out))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss/total", "loss/ce", "loss/ksvd", "ksvd/J/layer1", "lr", "acc/train", "acc/val", "acc/test",
                "throughput/samples_per_s", "throughput/s_per_1k_steps"):
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("acc/val")] == [3, 6]
    assert "ksvd/J/layer0" not in tags  # layer 0 is softmax in primal+trans


def test_listops_run_on_generated_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # generated files go to ./data/listops/<spec>
    argv = ["task=lra/listops-fast", "model=primalformer", "train.steps=4", "train.eval_every=2",
            "data.listops.n_train=24", "data.listops.n_val=8", "data.listops.n_test=8", "data.listops.min_length=5",
            "data.listops.max_length=30", "data.max_len=32", "train.batch_size=8", "primal.s=8", f"out={tmp_path}/runs", *TINY]
    summary = run(argv)
    assert summary["layers"] == ["primal", "primal"] and summary["steps"] == 4
    assert list((tmp_path / "data" / "listops").glob("*/basic_test.tsv"))


def test_a_onecycle_run_resumes_only_at_its_length(tmp_path, monkeypatch):
    """The schedule is laid out for the run's steps: more steps would step it past its end (a traceback once)."""
    monkeypatch.chdir(tmp_path)
    argv = ["task=lra/listops-fast", "train.steps=2", "train.eval_every=2", "data.listops.n_train=8",
            "data.listops.n_val=4", "data.listops.n_test=4", "data.listops.min_length=5", "data.listops.max_length=20",
            "data.max_len=24", "train.batch_size=4", f"out={tmp_path}/runs", *TINY]
    d = run(argv)["run_dir"]
    with pytest.raises(SetupError, match="onecycle-linear schedule laid out for train.steps=2, train.epochs=0"):
        run([f"resume={d}", "train.steps=4", "progress=false"])
    assert run([f"resume={d}", "data.generate=false", "progress=false"])["steps"] == 2


def test_paper_protocol_selects_on_test(tmp_path):
    argv = ["task=uea/JapaneseVowels-fast", "model=transformer", "train.epochs=1", "train.selection=test",
            "data.max_train=20", "data.max_test=20", f"out={tmp_path}", *TINY]
    summary = run(argv)
    assert summary["protocol"] == "test" and summary["selected_val_acc"] is None


@pytest.mark.parametrize("argv, message", [
    (["task=uea/JapaneseVowel"], "Did you mean 'uea/JapaneseVowels'"),
    (["task=lra/listop-fast"], "Did you mean 'lra/listops-fast'"),
    (["model=primalformr"], "unknown model layout 'primalformr'"),
    (["train.steps=10"], "exactly one of train.epochs / train.steps"),
    (["data.kind=uae"], "Did you mean 'uea'"),
    (["data.val_fraction=1.5"], "data.val_fraction must be in [0, 1)"),
    (["attention_options=1,2"], "attention_options: '1' is not mechanism.option=value"),
    (["task=lra/listops"], "data.generate=true"),
    (["device=gpu"], "device must be auto, cpu, cuda or cuda:N"),
    (["attention_options=softmx.window=3"], "unknown attention mechanism 'softmx'"),
    (["resume=/nonexistent/run"], "resume=/nonexistent/run: no checkpoint at /nonexistent/run;"),
])
def test_bad_input_fails_before_training(tmp_path, argv, message):
    with pytest.raises(SetupError) as err:
        run([*argv, f"out={tmp_path}", "progress=false"])
    assert message in str(err.value)
    assert not any(tmp_path.iterdir()), "nothing is written before the input is known to be good"


def test_preset_layers_and_command_line_precedence():
    cfg, source = build_config(["task=uea/JapaneseVowels", "model=primalformer", "primal.eta=0.3"])
    assert (cfg.arch.d_model, cfg.arch.norm, cfg.train.optimizer) == (512, "post", "radam")
    assert (cfg.primal.s, cfg.primal.rank_multi, cfg.primal.eta) == (40, 5, 0.3)
    assert "Primal-Attention" in source
    assert build_config(["attention=linear"])[0].model == "linear"  # the shorthand primal_dt.train has too


@pytest.mark.parametrize("by_model", ["{transformer: 5}", "[transformer]"])
def test_a_preset_whose_by_model_is_no_mapping_is_named(tmp_path, monkeypatch, by_model):
    """A traceback (AttributeError) once, or a section silently ignored."""
    from primal_dt.run import presets

    (tmp_path / "lra").mkdir()
    (tmp_path / "lra" / "mine.yaml").write_text(f"by_model: {by_model}\n")
    monkeypatch.setattr(presets, "CONFIG_ROOT", tmp_path)
    with pytest.raises(ValueError, match="preset lra/mine: by_model must map model names to mappings of options"):
        build_config(["task=lra/mine"])


def test_command_line_error_exit(tmp_path):
    r = subprocess.run([sys.executable, "-m", "primal_dt.classify", "task=uea/Nope", f"out={tmp_path}"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "error: unknown task 'uea/Nope'" in r.stderr


def test_a_diverging_run_stops_with_one_line_instead_of_reporting_nan_weights(tmp_path, run_cli):
    r = run_cli("primal_dt.classify", "task=uea/JapaneseVowels-fast", "model=transformer", "train.lr=1e30",
                "train.epochs=2", "data.max_train=16", "data.max_val=9", "data.max_test=9", f"out={tmp_path}", *TINY)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: training diverged at step ") and "train.lr (now 1e+30)" in line
    assert not list(tmp_path.rglob("summary.json"))  # no accuracy reported for a NaN model


def test_resume_extends_a_finished_run(tmp_path, killed_checkpoint_write, capsys):
    base = ["task=uea/JapaneseVowels-fast", "model=transformer", "data.max_train=16", "data.max_val=9",
            "data.max_test=10", "train.batch_size=8", f"out={tmp_path}", *TINY]
    first = run([*base, "train.epochs=1"])
    stale = killed_checkpoint_write(Path(first["run_dir"]) / "last.pt")
    second = run([f"resume={first['run_dir']}/last.pt", "train.epochs=2", "progress=false"])  # file or directory
    assert not stale.exists() and "removed 1 temporary file(s)" in capsys.readouterr().err
    assert second["run_dir"] == first["run_dir"] and second["steps"] == 4
    ck = checkpoint.load(f"{first['run_dir']}/last.pt", expect_kind="classifier")
    assert ck["step"] == 4 and ck["config"]["train"]["epochs"] == 2
    assert torch.isfinite(torch.tensor(second["test_acc"]))
    last = Path(first["run_dir"]) / "last.pt"
    for argv, message in [(["arch.d_model=32"], "was trained with arch.d_model=16, but the command line asks for arch.d_model=32"),
                          (["task=uea/BasicMotions-fast"], "was trained with task='uea/JapaneseVowels-fast'"),
                          (["train.epochs=1"], "has taken 4 steps, more than the 2 asked for")]:
        with pytest.raises(SetupError, match=message):  # an option the checkpoint fixes is refused, not mixed in
            run([f"resume={first['run_dir']}", *argv, "progress=false"])
    for damage in ("train_time", "torch_rng"):  # a field lost, or a random state cut short: one line naming the file
        raw = torch.load(last, weights_only=True)
        raw.pop("train_time") if damage == "train_time" else raw.update(torch_rng=raw["torch_rng"][:100])
        torch.save(raw, last)
        with pytest.raises(SetupError, match=rf"checkpoint {last}: its training state does not fit .*the file is damaged"):
            run([f"resume={first['run_dir']}", "train.epochs=3", "progress=false"])


def test_resume_from_a_crafted_checkpoint_never_runs_it(tmp_path, crafted_checkpoint):
    marker = tmp_path / "pwned"
    crafted_checkpoint(tmp_path / "run" / "last.pt", marker)
    with pytest.raises(SetupError, match="was not loaded: it holds pickled objects other than tensors"):
        run([f"resume={tmp_path / 'run'}"])
    assert not marker.exists()


def test_validation_ties_go_to_lower_loss(tmp_path):
    from types import SimpleNamespace

    from primal_dt.classifier_training import Trainer, evaluation_round
    from primal_dt.tasks import load_task

    cfg, _ = build_config(["task=uea/JapaneseVowels-fast", "train.epochs=1", "data.max_train=10", "data.max_val=9",
                           "data.max_test=5", *TINY[:3]])
    data = load_task(cfg.data)
    tr = Trainer(cfg, data)
    val = iter([{"acc": 0.5, "loss": 2.0}, {"acc": 0.5, "loss": 1.0}, {"acc": 0.5, "loss": 3.0}])
    tr.evaluate = lambda split: next(val) if split is data.val else {"acc": 0.1, "loss": 9.0}
    steps = []
    for step in (1, 2, 3):
        tr.step_no = step
        evaluation_round(tr, SimpleNamespace(test=data.test, val=data.val), tmp_path)
        steps.append(tr.best["step"])
    assert steps == [1, 2, 2]


@pytest.mark.slow
def test_a_run_is_resumed_by_one_process_at_a_time(tmp_path):
    base = ["task=uea/JapaneseVowels-fast", "model=transformer", "data.max_train=16", "data.max_val=9",
            "data.max_test=10", "train.batch_size=8", f"out={tmp_path}", *TINY]
    d = Path(run([*base, "train.epochs=1"])["run_dir"])
    root = Path(__file__).resolve().parents[2]
    first = subprocess.Popen([sys.executable, "-m", "primal_dt.classify", f"resume={d}", "train.epochs=100000",
                              "progress=false"], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600  # minutes on a loaded machine; the loop ends as soon as it may
        while time.time() < deadline and first.poll() is None and (d / ".lock").read_text().strip() != str(first.pid):
            time.sleep(0.05)
        with pytest.raises(SetupError, match=f"the run directory {d} is in use by process {first.pid}"):
            run([f"resume={d}", "train.epochs=3", "progress=false"])
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert run([f"resume={d}", "train.epochs=3", "progress=false"])["run_dir"] == str(d)  # the kill freed it


@pytest.mark.parametrize("sig, first_round", [(signal.SIGTERM, 2), (signal.SIGINT, 100000)])
def test_sigterm_or_ctrl_c_says_which_checkpoint_holds_and_how_to_resume(tmp_path, sig, first_round):
    """SIGTERM (a cluster's time limit) ended a classifier with status 143 and not a word; now it is Ctrl-C's line
    (status 130): the step last.pt holds, the resume command, or that nothing was written yet."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "primal_dt.classify", "task=uea/JapaneseVowels-fast",
                             "model=transformer", "data.max_train=16", "data.max_val=9", "data.max_test=10",
                             "train.batch_size=8", "train.epochs=0", "train.steps=1000000", f"train.eval_every={first_round}",
                             f"out={tmp_path}", *TINY], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    deadline = time.time() + 600  # minutes on a loaded machine; the loop ends as soon as it may
    while time.time() < deadline and proc.poll() is None and not (
            list(tmp_path.rglob("last.pt")) if first_round == 2 else list(tmp_path.rglob("events.*"))):
        time.sleep(0.01)
    time.sleep(1.0)  # steps past the checkpoint
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("interrupted")]
    by = " by SIGTERM" if sig == signal.SIGTERM else ""
    (run_dir,) = {p.parent for p in tmp_path.rglob("events.*")}
    if first_round == 2:
        held = checkpoint.load(run_dir / "last.pt", expect_kind="classifier")["step"]
        assert line.startswith(f"interrupted{by} at step ") and held > 0 and held % 2 == 0
        assert line.endswith(f"; last.pt holds step {held}, the last evaluation round; resume with: "
                             f"python -m primal_dt.classify resume={run_dir}")
        assert run([f"resume={run_dir}", f"train.steps={held + 2}", "progress=false"])["steps"] == held + 2
    else:
        assert line.endswith("before the first evaluation round (step 100000) wrote a checkpoint: nothing to resume")
        assert not (run_dir / "last.pt").exists()
