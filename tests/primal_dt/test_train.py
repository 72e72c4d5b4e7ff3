"""python -m primal_dt.train end to end on real Hopper data: logging, determinism, checkpoints,
resume after a kill, divergence, and bad input rejected before training."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from agents import dt_checkpoint
from primal_dt.run import checkpoint
from primal_dt.train import Diverged, SetupError, run

ROOT = Path(__file__).resolve().parents[2]




def test_run_logs_evaluates_checkpoints_and_plots(hopper_file, tmp_path, tiny_train):
    summary = run(tiny_train.args(hopper_file, tmp_path, "steps=12", "log_every=4", "eval.every=6", "eval.episodes=1",
                       "eval.final_episodes=2", "eval.max_steps=15", "eval.num_envs=4", "checkpoint_every=6"))
    d = Path(summary["run_dir"])
    assert d.parent == tmp_path / "hopper-medium" / "primal+dt" and d.name.endswith("-seed0")
    acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss/total", "loss/action_mse", "loss/ksvd", "ksvd/J_layer1", "lambda/layer1_mean", "train/lr",
                "train/grad_norm", "throughput/steps_per_s", "throughput/tokens_per_s",
                "eval/normalized/target3600", "eval/normalized/target1800", "eval/return/target3600"):
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("loss/total")] == [4, 8, 12]
    assert [e.step for e in acc.Scalars("eval/normalized/target3600")] == [6, 12]  # periodic + final
    assert "lambda/layer1" in acc.Tags()["histograms"]
    lr = [e.value for e in acc.Scalars("train/lr")]
    assert lr == pytest.approx([1e-3, 1e-3, 1e-3])  # the 5-step warm-up reaches lr after 4 scheduler steps
    texts = acc.Tags()["tensors"]
    assert "data/source/text_summary" in texts and "config/text_summary" in texts
    source = acc.Tensors("data/source/text_summary")[0].tensor_proto.string_val[0].decode()
    assert str(hopper_file) in source
    assert (d / "eval_return.png").stat().st_size > 1000
    saved = json.loads((d / "summary.json").read_text())
    assert saved["final"]["target3600"]["episodes"] == 2 and saved["steps"] == 12
    ck = dt_checkpoint.load(d / "last.pt")
    assert ck.step == 12 and ck.data.source == f"d4rl:{hopper_file}"
    assert ck.data.state_mean.shape == (11,) and ck.data.reward_scale == 1000.0
    assert ck.data.targets == (3600.0, 1800.0) and ck.config["steps"] == 12
    model = ck.build_model()
    assert model.layer_names == ["softmax", "primal"] and model.cfg.K == 5


def test_same_seed_same_losses_other_seed_other_losses(hopper_file, tmp_path, tiny_train):
    def losses(seed, sub):
        s = run(tiny_train.args(hopper_file, tmp_path / sub, "steps=6", "log_every=1", f"seed={seed}", *tiny_train.QUIET))
        return tiny_train.scalars(s["run_dir"], "loss/total")

    a, b, c = losses(0, "a"), losses(0, "b"), losses(1, "c")
    assert a == b and len(a) == 6
    assert a != c


def test_resume_after_kill_matches_uninterrupted_run(hopper_file, tmp_path, tiny_train):
    common = tiny_train.args(hopper_file, tmp_path, "steps=150", "log_every=5", "checkpoint_every=10", *tiny_train.QUIET)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "primal_dt.train", *common, "out=" + str(tmp_path / "killed")],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    killed_dir = tmp_path / "killed" / "hopper-medium" / "primal+dt"
    deadline = time.time() + 600  # minutes on a loaded machine; the loop ends as soon as it may
    while time.time() < deadline and not list(killed_dir.glob("*/last.pt")) and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (last,) = killed_dir.glob("*/last.pt")
    step = dt_checkpoint.load(last).step
    assert 0 < step < 150, f"the run was not killed mid-way (checkpoint at step {step})"
    resumed = run(["resume=" + str(last.parent), "progress=false", "threads=1"])
    assert resumed["steps"] == 150 and Path(resumed["run_dir"]) == last.parent
    straight = run(common + ["out=" + str(tmp_path / "straight")])
    a = dt_checkpoint.load(resumed["run_dir"]).model
    b = dt_checkpoint.load(straight["run_dir"]).model
    assert all(torch.equal(a[k], b[k]) for k in b)
    # TensorBoard: the killed run's steps after its checkpoint are purged, the rest continue exactly
    assert tiny_train.scalars(resumed["run_dir"], "loss/total") == tiny_train.scalars(straight["run_dir"], "loss/total")


def ctrl_c_enabled():
    """A process started in the background of a non-interactive shell inherits SIGINT ignored, and Python then
    never raises KeyboardInterrupt: give the trainer Ctrl-C as a terminal gives it, however pytest was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_says_how_to_continue_and_exits_130(hopper_file, tmp_path, tiny_train):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "primal_dt.train", *tiny_train.args(hopper_file, tmp_path, "steps=100000",
                                                                             "checkpoint_every=5", *tiny_train.QUIET)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_enabled)
    run_dirs = tmp_path / "hopper-medium" / "primal+dt"
    deadline = time.time() + 600  # minutes on a loaded machine; the loop ends as soon as it may
    while time.time() < deadline and not list(run_dirs.glob("*/last.pt")) and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    (run_dir,) = run_dirs.iterdir()
    assert proc.returncode == 130, err[-2000:]
    assert f"; continue with: python -m primal_dt.train resume={run_dir}" in out and "Traceback" not in err


def test_ctrl_c_writes_a_checkpoint_at_the_step_reached_which_resumes_exactly(hopper_file, tmp_path, tiny_train):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    no_periodic = ("checkpoint_every=0", "checkpoint_minutes=0", "log_every=1")
    proc = subprocess.Popen([sys.executable, "-m", "primal_dt.train", *tiny_train.args(
        hopper_file, tmp_path / "cut", "steps=100000", *no_periodic, *tiny_train.QUIET, "progress=true")], cwd=ROOT,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=ctrl_c_enabled)
    run_dirs = tmp_path / "cut" / "hopper-medium" / "primal+dt"
    deadline = time.time() + 600  # minutes on a loaded machine; the loop ends as soon as it may
    while time.time() < deadline and not list(run_dirs.glob("*/events.*")) and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(2.0)  # some steps in, with no checkpoint written by schedule
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)  # the progress bar and the lines, in the order they were written
    assert proc.returncode == 130 and "Traceback" not in out, out[-2000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("interrupted at step ")]
    # written to a pipe: no bar frames (plain progress lines at most once a minute), and none after the line
    assert "\r" not in out and not re.search(r"^step \d", out[out.index(line):], re.M)
    step = int(line.split()[3].rstrip(":"))
    (run_dir,) = run_dirs.iterdir()
    assert "checkpoint written at this step" in line and line.endswith(f"resume={run_dir}")
    assert step > 0 and dt_checkpoint.load(run_dir).step == step
    resumed = run([f"resume={run_dir}", f"steps={step + 5}", "progress=false", "threads=1"])
    straight = run(tiny_train.args(hopper_file, tmp_path / "straight", f"steps={step + 5}", *no_periodic,
                                   *tiny_train.QUIET))
    a, b = (dt_checkpoint.load(r["run_dir"]).model for r in (resumed, straight))
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_in_the_final_evaluation_says_what_is_kept_and_how_to_evaluate_it(
        sig, hopper_file, tmp_path, tiny_train):
    """The final evaluation (minutes, with the papers' episode counts) ran outside the trainer's interrupt handling:
    Ctrl-C there ended the run with status 130 and not a word, SIGTERM (a cluster's time limit) with -15 and not a
    word. The checkpoint of the last step is written before it, so the line names that checkpoint and the resume
    that evaluates it again."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "primal_dt.train", *tiny_train.args(
        hopper_file, tmp_path, "steps=2", "eval.every=0", "eval.final_episodes=500", "eval.num_envs=2",
        "eval.max_steps=1000")], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=ctrl_c_enabled)
    run_dirs = tmp_path / "hopper-medium" / "primal+dt"
    deadline = time.time() + 600  # minutes on a loaded machine; the loop ends as soon as it may
    while time.time() < deadline and not list(run_dirs.glob("*/last.pt")) and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(1.0)  # into the final evaluation (1000 episodes: minutes)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    (run_dir,) = run_dirs.iterdir()
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("interrupted")]
    by = " by SIGTERM" if sig == signal.SIGTERM else ""
    assert line.startswith(f"interrupted{by} during the final evaluation at step 2; the last good checkpoint ")
    assert line.endswith(f"(step 2) is intact; continue with: python -m primal_dt.train resume={run_dir}")
    assert not (run_dir / "summary.json").exists()


def test_the_final_evaluation_names_its_engine_and_whether_it_measured_the_trained_policy(hopper_file, tmp_path,
                                                                                          capsys, tiny_train):
    """The final score is the one users report: its line says which engine measured it and whether that is the
    policy training optimised (primal+dt trained on segments: recompute is, the unwindowed stream is not)."""
    for engine, policy in (("recompute", "the trained policy"), ("stream", "NOT the trained policy")):
        run(tiny_train.args(hopper_file, tmp_path / engine, "steps=2", "eval.every=0", "eval.final_episodes=1",
                            "eval.num_envs=1", "eval.max_steps=5", f"eval.engine={engine}"))
        (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("final eval")]
        assert line.startswith(f"final eval by engine={engine} ({policy}) (1 episodes/target, "), line


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(hopper_file, tmp_path, capsys, tiny_train):
    with pytest.raises(Diverged, match="diverged at step") as err:
        # (lr 1e4: weights far beyond any the checkpoint reader accepts come from a larger one, in the first step)
        run(tiny_train.args(hopper_file, tmp_path, "steps=50", "lr=1e4", "warmup_steps=0", "grad_clip=0", "checkpoint_every=1",
                 *tiny_train.QUIET))
    assert "last good checkpoint" in str(err.value)
    (last,) = (tmp_path / "hopper-medium" / "primal+dt").glob("*/last.pt")
    ck = dt_checkpoint.load(last)
    assert 1 <= ck.step < 50 and f"(step {ck.step})" in str(err.value)
    assert all(torch.isfinite(v).all() for v in ck.model.values() if v.is_floating_point())


@pytest.mark.parametrize("extra, msg", [
    (["env=hopper-mediun"], "Did you mean 'hopper-medium'"),
    (["preset=nope"], "unknown dt preset 'nope'"),
    (["model=primal+nope"], "unknown model 'primal\\+nope'"),
    (["attention=softmaxx"], "Did you mean"),
    (["model=nystrom"], "no causal form"),
    (["model.layers=softmax,linformer"], "no causal form"),
    (["K=0"], "K must be >= 1"),
    (["model.s=0"], "model.s must be >= 1"),
    (["model.s=64"], "exceed d_model=32"),
    (["lr=-0.001"], "lr must be > 0"),
    (["eta=-0.1"], "eta must be >= 0"),
    (["model.attention_options=softmax.windw=3"], "does not accept option 'windw'"),
    (["model.attention_options=primal.window=4,softmx.window=3"], "unknown attention mechanism 'softmx'"),
    (["model.attention_options={softmax: {window: 3}}"], "is not mechanism.option=value; write e.g. "
                                                        "model.attention_options=softmax.window=30"),
    (["device=gpu"], "device must be auto, cpu, cuda or cuda:N"),
    (["compile=cudagraphs"], "compile=cudagraphs needs a CUDA device"),
    (["data_source=d4rl:/nonexistent.hdf5"], "no D4RL file at"),

    (["stream_window=10"], "K must be >= 7"),  # 2 layers x 9 tokens of reach > a 5-step segment
    (["model=linear", "stream_window=4"], "needs every layer windowed"),
    (["from_start=true"], "from_start=true .* needs K >= max_timestep"),  # a 5-step segment is no episode prefix
    (["from_start=true", "K=40", "max_timestep=40", "stream_window=4"], "and no stream_window"),
])
def test_bad_input_fails_before_training(hopper_file, tmp_path, extra, msg, tiny_train):
    with pytest.raises(SetupError, match=msg):
        run(tiny_train.args(hopper_file, tmp_path, *extra, *tiny_train.QUIET))
    assert not (tmp_path / "hopper-medium").exists()  # nothing written


def test_resume_refuses_another_env_or_model(hopper_file, tmp_path, tiny_train):
    s = run(tiny_train.args(hopper_file, tmp_path, "steps=2", *tiny_train.QUIET))
    for extra, msg in ((["env=walker2d-medium"], "env='hopper-medium'"),
                       (["model=dt"], "model.name='primal\\+dt'")):
        with pytest.raises(SetupError, match=msg):
            run(["resume=" + s["run_dir"], *extra])
    checkpoint.save_atomic({"kind": "classifier", "config": {}, "model": {}}, tmp_path / "c.pt")
    with pytest.raises(SetupError, match="expected 'dt'"):
        run([f"resume={tmp_path / 'c.pt'}"])
    with pytest.raises(SetupError, match="no checkpoint"):
        run([f"resume={tmp_path / 'missing'}"])


def test_stream_exact_training_counts_only_stream_exact_steps(hopper_file, tmp_path, tiny_train, capsys):
    """stream_window windows every layer, masks the loss to the steps the stream engine predicts
    identically, and its checkpoint streams exactly what a forward pass over the episode gives; the trainer and
    eval.rollout evaluate it by that stream unless told otherwise."""
    from agents import load_agent
    from agents.stream_training import first_exact_step, receptive_field
    from eval import rollout

    s = run(tiny_train.args(hopper_file, tmp_path, "steps=3", "stream_window=4", "eval.every=0",
                 "eval.final_episodes=1", "eval.max_steps=12", "eval.num_envs=2"))
    assert s["engine"] == "stream"  # no engine given: the stream it trained for
    common = [f"checkpoint={s['run_dir']}", "episodes=1", "max_steps=5", "num_envs=1", "progress=false"]
    capsys.readouterr()
    report = rollout.main(common)
    assert (report["engine"], report["exact"], report["stream_window"]) == ("stream", True, 4)
    assert "is trained for the stream (stream_window=4)" in capsys.readouterr().out
    assert rollout.main([*common, "engine=recompute"])["engine"] == "recompute"  # told: exact too
    model = dt_checkpoint.load(s["run_dir"]).build_model()
    assert model.cfg.options()["softmax"]["window"] == 4 and model.cfg.options()["primal"]["window"] == 4
    reach = receptive_field(model.cfg)
    assert reach == 6 and first_exact_step(model.cfg) == 2
    assert s["final"]["target3600"]["episodes"] == 1
    # the trained checkpoint streams exactly what the model computes over the whole episode
    ckpt = Path(s["run_dir"]) / "last.pt"
    stream, full = load_agent(ckpt, engine="stream", runtime="torch"), load_agent(ckpt, engine="recompute", context=30)
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(30, 2, 11, generator=g).numpy()
    for agent in (stream, full):
        agent.reset(2)
    for t in range(30):
        rew = None if t == 0 else [1.0, 2.0]
        a, b = stream.act(obs[t], rew), full.act(obs[t], rew)
        assert a.shape == (2, 3)
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-5)


# -- runs that never clobber each other ----------------------------------------------------------------
def start_together(hopper_file, out, pairs: int, tiny_train) -> list[subprocess.Popen]:
    """2 x ``pairs`` real training processes started at once, same seed, same ``out``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "primal_dt.train", *tiny_train.args(hopper_file, out, "steps=3", "log_every=1", *tiny_train.QUIET)]
    return [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2 * pairs)]


def check_distinct_and_intact(procs, out, tiny_train):
    """Every process succeeded in its own directory, holding its own whole checkpoint, summary and
    event files (their names carry the writer's pid), with its own complete loss curve."""
    summaries = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-2000:]
        (line,) = [ln for ln in stdout.splitlines() if ln.startswith("summary: ")]  # the run names its summary
        summaries.append(json.loads(Path(line.removeprefix("summary: ")).read_text()))
    dirs = sorted((out / "hopper-medium" / "primal+dt").iterdir())
    assert len(dirs) == len(procs) == len({s["run_dir"] for s in summaries})
    assert sorted(Path(s["run_dir"]) for s in summaries) == dirs
    for d in dirs:
        assert json.loads((d / "summary.json").read_text())["run_dir"] == str(d)
        assert dt_checkpoint.load(d).step == 3
        pids = {f.name.split(".")[-2] for f in d.glob("events.out.tfevents.*")}
        assert len(pids) == 1, f"event files of several processes in {d}"
        assert [s for s, _ in tiny_train.scalars(d, "loss/total")] == [1, 2, 3]


@pytest.mark.slow
def test_runs_started_together_never_share_a_directory(hopper_file, tmp_path, tiny_train):
    check_distinct_and_intact(start_together(hopper_file, tmp_path, 3, tiny_train), tmp_path, tiny_train)


@pytest.mark.slow
def test_twenty_pairs_started_together_get_forty_directories(hopper_file, tmp_path, tiny_train):
    check_distinct_and_intact(start_together(hopper_file, tmp_path, 20, tiny_train), tmp_path, tiny_train)


# -- checkpoints that cannot run code ------------------------------------------------------------------
def test_resume_from_a_crafted_checkpoint_is_refused_and_its_payload_never_runs(tmp_path, crafted_checkpoint,
                                                                              run_cli, one_line_error):
    marker = tmp_path / "pwned"
    crafted_checkpoint(tmp_path / "run" / "last.pt", marker)
    p = run_cli("primal_dt.train", f"resume={tmp_path / 'run'}", "progress=false")
    one_line_error(p, f"checkpoint {tmp_path / 'run' / 'last.pt'} was not loaded", "could run code")
    assert not marker.exists()


# -- a full disk, an unwritable out, stale temporaries ---------------------------------------------------
@pytest.mark.slow
def test_a_full_disk_ends_with_one_line_and_keeps_the_last_checkpoint(hopper_file, tmp_path, run_cli, one_line_error, tiny_train):
    first = run(tiny_train.args(hopper_file, tmp_path, "steps=4", "checkpoint_every=2", *tiny_train.QUIET))
    d = Path(first["run_dir"])
    last = d / "last.pt"
    before = last.read_bytes()
    # the next checkpoint cannot be written: a real file-size limit below its size (the log still fits)
    p = run_cli("primal_dt.train", f"resume={d}", "steps=8", "progress=false", file_size=len(before) // 2)
    one_line_error(p, f"could not write the checkpoint (step 6) {last}: file too large",
                   f"the last good checkpoint {last} (step 4) is intact",
                   f"continue with: python -m primal_dt.train resume={d}", status=1)
    assert last.read_bytes() == before and not list(d.glob(".*.tmp"))
    resumed = run([f"resume={d}", "steps=8", "progress=false"])  # room again: the run goes on
    assert resumed["steps"] == 8 and dt_checkpoint.load(d).step == 8


@pytest.mark.slow
def test_an_unwritable_out_is_one_line_before_any_training(hopper_file, tmp_path, run_cli, one_line_error, tiny_train):
    (tmp_path / "file").write_text("x")
    p = run_cli("primal_dt.train", *tiny_train.args(hopper_file, tmp_path / "file" / "runs", *tiny_train.QUIET))
    one_line_error(p, "could not write the run directory", "a part of the path is a file", "Choose a writable out=",
                   status=1)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    p = run_cli("primal_dt.train", *tiny_train.args(hopper_file, locked, *tiny_train.QUIET), honour_permissions=True)
    one_line_error(p, f"could not write the run directory {locked / 'hopper-medium' / 'primal+dt'}: permission denied",
                   status=1)
    assert not any(locked.iterdir())


@pytest.mark.slow
def test_temporaries_of_killed_checkpoint_writes_are_removed_at_resume_and_at_the_next_start(
        hopper_file, tmp_path, killed_checkpoint_write, capsys, tiny_train):
    d = Path(run(tiny_train.args(hopper_file, tmp_path, "steps=2", *tiny_train.QUIET))["run_dir"])
    stale, summary = killed_checkpoint_write(d / "last.pt"), killed_checkpoint_write(d / "summary.json")
    run([f"resume={d}", "steps=3", "progress=false"])
    err = capsys.readouterr().err
    assert not stale.exists() and not summary.exists() and "removed 2 temporary file(s) of interrupted writes: " in err
    assert str(stale) in err and str(summary) in err
    stale = killed_checkpoint_write(d / "last.pt")
    other = Path(run(tiny_train.args(hopper_file, tmp_path, "steps=1", *tiny_train.QUIET))["run_dir"])  # a new run beside it
    assert other != d and not stale.exists() and dt_checkpoint.load(d).step == 3


# -- data that cannot be silently wrong ----------------------------------------------------------------
def rewrite(path, **change):
    """The D4RL file at ``path`` rewritten in place with some of its arrays changed."""
    import h5py

    with h5py.File(path) as f:
        arrays = {k: f[k][()] for k in f}
    path.unlink()
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=change[k](v) if k in change else v)
    return path


def test_actions_outside_the_action_space_stop_training_unless_clipping_is_asked(tmp_path, write_hopper_file, tiny_train):
    from envs import load_dataset

    data = rewrite(write_hopper_file(tmp_path / "x5-v2.hdf5"), actions=lambda a: 5 * a)
    with pytest.raises(SetupError, match=r"action values \(.* steps\) lie outside Hopper-v4's action space \[-1, 1\]; "
                                         r"they range over \[-5, 5\].*data_clip_actions=true"):
        run(tiny_train.args(data, tmp_path / "out", *tiny_train.QUIET))
    assert not (tmp_path / "out").exists()
    s = run(tiny_train.args(data, tmp_path / "out", "data_clip_actions=true", "steps=1", *tiny_train.QUIET))
    clipped = load_dataset("hopper-medium", source=f"d4rl:{data}", clip_actions=True, verbose=False)
    assert float(abs(clipped.actions).max()) == 1.0
    assert dt_checkpoint.load(s["run_dir"]).data.fingerprint == clipped.fingerprint


def test_resume_refuses_data_changed_under_the_same_path(tmp_path, write_hopper_file, tiny_train):
    data = write_hopper_file(tmp_path / "hopper-v2.hdf5")
    d = Path(run(tiny_train.args(data, tmp_path, "steps=2", *tiny_train.QUIET))["run_dir"])
    rewrite(data, actions=lambda a: 0.5 * a)  # same path, same statistics of the states, other actions
    with pytest.raises(SetupError, match=rf"checkpoint {re.escape(str(d / 'last.pt'))} was trained on d4rl:{data} "
                                         rf"\(dataset fingerprint sha256:.*\), but the data read now from "
                                         rf"d4rl:{data} differs"):
        run([f"resume={d}", "steps=3"])
    assert dt_checkpoint.load(d).step == 2


def test_every_numeric_option_is_valid_or_named_before_training(hopper_file, tmp_path, fuzz_options, tiny_train):
    """Random values for the numeric options: ``prepare`` (everything before the first step) returns
    a run, or stops with an error naming an option given; nothing is written either way."""
    from agents import training
    from agents import train_config

    sizes = {f"model.{k}": "size" for k in ("d_model", "n_heads", "n_layers", "s")}
    sizes.update({k: "size" for k in ("K", "batch_size", "max_timestep", "stream_window", "eval.num_envs")})
    numbers = {k: "int" for k in ("seed", "steps", "warmup_steps", "checkpoint_every", "log_every", "threads",
                                  "eval.every", "eval.episodes", "eval.final_episodes", "eval.max_steps")}
    numbers.update({k: "float" for k in ("lr", "weight_decay", "grad_clip", "eta", "reward_scale", "model.dropout",
                                         "model.mlp_ratio")})
    fuzz_options(lambda argv: training.prepare(train_config.build(argv)), {**sizes, **numbers, "eval.targets": "floats"},
                 base=tiny_train.args(hopper_file, tmp_path / "out"), examples=80)
    assert not (tmp_path / "out").exists()


# -- one process per run directory ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_is_resumed_by_one_process_at_a_time_and_a_killed_one_blocks_nothing(hopper_file, tmp_path, run_cli,
                                                                                   one_line_error, tiny_train):
    """Two ``resume=RUN`` at once: the second is refused with the first's pid before it trains or writes;
    after a SIGKILL of the first (no clean-up of any kind) the run resumes at once."""
    d = Path(run(tiny_train.args(hopper_file, tmp_path, "steps=4", "checkpoint_every=2", *tiny_train.QUIET))["run_dir"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-m", "primal_dt.train", f"resume={d}", "steps=100000",
                              "progress=false", "threads=1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 600  # minutes on a loaded machine; the loop ends as soon as it may
        while time.time() < deadline and first.poll() is None and not list(d.glob(f"events.out.tfevents.*.{first.pid}.*")):
            time.sleep(0.05)  # the first holds the run and has opened its log
        assert first.poll() is None
        events = sorted(d.glob("events.out.tfevents.*"))
        second = run_cli("primal_dt.train", f"resume={d}", "steps=100000", "progress=false")
        one_line_error(second, f"the run directory {d} is in use by process {first.pid}")
        assert "resuming" not in second.stdout and sorted(d.glob("events.out.tfevents.*")) == events
        # refused before the expensive work: no data loaded, no config printed
        assert "[envs]" not in second.stdout + second.stderr and "source" not in second.stdout
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    step = dt_checkpoint.load(d).step
    again = run([f"resume={d}", f"steps={step + 2}", "progress=false", "threads=1"])
    assert again["steps"] == step + 2 and not (d / ".lock").exists()  # a finished run leaves no lock file


def test_a_resume_into_a_run_whose_lock_is_a_planted_link_leaves_its_target_untouched(hopper_file, tmp_path, run_cli,
                                                                                       one_line_error, tiny_train):
    d = Path(run(tiny_train.args(hopper_file, tmp_path, "steps=2", *tiny_train.QUIET))["run_dir"])
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    assert not (d / ".lock").exists()  # the finished run removed its own
    (d / ".lock").symlink_to(victim)
    p = run_cli("primal_dt.train", f"resume={d}", "steps=4", "progress=false")
    one_line_error(p, f"the lock file of the run directory, {d / '.lock'}, is a symbolic link (to {victim})",
                   f"remove {d / '.lock'}")
    assert victim.read_text() == "precious\n" and dt_checkpoint.load(d).step == 2


def test_a_resume_waiting_for_a_busy_run_never_continues_from_the_state_it_replaced(hopper_file, tmp_path,
                                                                                   tiny_train):
    """Two resumes of one run: while the first holds the run (it trains from step 4 to 8 and writes), the second
    is refused; once the first has ended the second continues from what the first wrote, not from the checkpoint
    it would have read had it read before holding the run."""
    d = Path(run(tiny_train.args(hopper_file, tmp_path, "steps=4", "checkpoint_every=2", *tiny_train.QUIET))["run_dir"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "primal_dt.train", f"resume={d}", "progress=false", "threads=1"]
    first = subprocess.Popen([*argv, "steps=8"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    from primal_dt.run import lock

    while first.poll() is None and lock.holder(d) != f"process {first.pid}":
        time.sleep(0.01)
    while first.poll() is None:  # every resume tried while the first runs is refused, whenever it comes
        second = subprocess.run([*argv, "steps=10"], cwd=ROOT, env=env, capture_output=True, text=True)
        if second.returncode == 0:
            break
        assert second.returncode == 2 and f"the run directory {d} is in use by process {first.pid}" in second.stderr
        assert "[envs]" not in second.stdout + second.stderr
    out, _ = first.communicate()
    assert first.returncode == 0, out[-2000:]
    if second.returncode != 0:  # the first ended before a try got through: resume now
        second = subprocess.run([*argv, "steps=10"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming at step 8" in second.stdout  # the first's finished work, continued
    assert dt_checkpoint.load(d).step == 10 and json.loads((d / "summary.json").read_text())["steps"] == 10
