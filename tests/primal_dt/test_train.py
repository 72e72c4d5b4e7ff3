"""python -m primal_dt.train end to end on real Hopper data: logging, determinism, checkpoints,
resume after a kill, divergence, and bad input rejected before training."""

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

from agents import dt_checkpoint
from primal_dt import checkpoint
from primal_dt.train import Diverged, SetupError, run

ROOT = Path(__file__).resolve().parents[2]
TINY = ["preset=smoke", "progress=false", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.s=8",
        "K=5", "batch_size=8", "warmup_steps=5", "threads=1"]
QUIET = ["eval.every=0", "eval.final_episodes=0"]


def args(hopper_file, out, *extra):
    return [*TINY, f"data_source=d4rl:{hopper_file}", f"out={out}", *extra]


def scalars(run_dir, tag):
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_run_logs_evaluates_checkpoints_and_plots(hopper_file, tmp_path):
    summary = run(args(hopper_file, tmp_path, "steps=12", "log_every=4", "eval.every=6", "eval.episodes=1",
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


def test_same_seed_same_losses_other_seed_other_losses(hopper_file, tmp_path):
    def losses(seed, sub):
        s = run(args(hopper_file, tmp_path / sub, "steps=6", "log_every=1", f"seed={seed}", *QUIET))
        return scalars(s["run_dir"], "loss/total")

    a, b, c = losses(0, "a"), losses(0, "b"), losses(1, "c")
    assert a == b and len(a) == 6
    assert a != c


def test_resume_after_kill_matches_uninterrupted_run(hopper_file, tmp_path):
    common = args(hopper_file, tmp_path, "steps=150", "log_every=5", "checkpoint_every=10", *QUIET)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "primal_dt.train", *common, "out=" + str(tmp_path / "killed")],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    killed_dir = tmp_path / "killed" / "hopper-medium" / "primal+dt"
    deadline = time.time() + 120
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
    assert scalars(resumed["run_dir"], "loss/total") == scalars(straight["run_dir"], "loss/total")


def test_ctrl_c_says_how_to_continue_and_exits_130(hopper_file, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "primal_dt.train", *args(hopper_file, tmp_path, "steps=100000",
                                                                             "checkpoint_every=5", *QUIET)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dirs = tmp_path / "hopper-medium" / "primal+dt"
    deadline = time.time() + 120
    while time.time() < deadline and not list(run_dirs.glob("*/last.pt")) and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    (run_dir,) = run_dirs.iterdir()
    assert proc.returncode == 130, err[-2000:]
    assert f"; continue with: python -m primal_dt.train resume={run_dir}" in out and "Traceback" not in err


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(hopper_file, tmp_path, capsys):
    with pytest.raises(Diverged, match="diverged at step") as err:
        run(args(hopper_file, tmp_path, "steps=50", "lr=1e30", "warmup_steps=0", "grad_clip=0", "checkpoint_every=1",
                 *QUIET))
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
    (["model.attention_options={softmax: {windw: 3}}"], "does not accept option"),
    (["model.attention_options={softmx: {window: 3}}"], "unknown attention mechanism 'softmx'"),
    (["model.attention_options=[1]"], "model.attention_options must be a YAML mapping"),
    (["device=gpu"], "device must be auto, cpu, cuda or cuda:N"),
    (["data_source=d4rl:/nonexistent.hdf5"], "no file at"),
    (["eval.engine=fast"], "eval.engine must be recompute or stream"),
    (["stream_window=10"], "K must be >= 7"),  # 2 layers x 9 tokens of reach > a 5-step segment
    (["model=linear", "stream_window=4"], "needs every layer windowed"),
])
def test_bad_input_fails_before_training(hopper_file, tmp_path, extra, msg):
    with pytest.raises(SetupError, match=msg):
        run(args(hopper_file, tmp_path, *extra, *QUIET))
    assert not (tmp_path / "hopper-medium").exists()  # nothing written


def test_resume_refuses_another_env_or_model(hopper_file, tmp_path):
    s = run(args(hopper_file, tmp_path, "steps=2", *QUIET))
    for extra, msg in ((["env=walker2d-medium"], "env='hopper-medium'"),
                       (["model=dt"], "model.name='primal\\+dt'")):
        with pytest.raises(SetupError, match=msg):
            run(["resume=" + s["run_dir"], *extra])
    checkpoint.save_atomic({"kind": "classifier", "config": {}, "model": {}}, tmp_path / "c.pt")
    with pytest.raises(SetupError, match="expected 'dt'"):
        run([f"resume={tmp_path / 'c.pt'}"])
    with pytest.raises(SetupError, match="no checkpoint"):
        run([f"resume={tmp_path / 'missing'}"])


def test_stream_exact_training_counts_only_stream_exact_steps(hopper_file, tmp_path):
    """stream_window windows every layer, masks the loss to the steps the stream engine predicts
    identically, and its checkpoint streams exactly what a forward pass over the episode gives."""
    from agents import load_agent
    from agents.stream_training import first_exact_step, receptive_field

    s = run(args(hopper_file, tmp_path, "steps=3", "stream_window=4", "eval.engine=stream", "eval.every=0",
                 "eval.final_episodes=1", "eval.max_steps=12", "eval.num_envs=2"))
    model = dt_checkpoint.load(s["run_dir"]).build_model()
    assert model.cfg.options["softmax"]["window"] == 4 and model.cfg.options["primal"]["window"] == 4
    reach = receptive_field(model.cfg)
    assert reach == 6 and first_exact_step(reach) == 2
    assert s["final"]["target3600"]["episodes"] == 1
    # the trained checkpoint streams exactly what the model computes over the whole episode
    ckpt = Path(s["run_dir"]) / "last.pt"
    stream, full = load_agent(ckpt, engine="stream"), load_agent(ckpt, engine="recompute", context=30)
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(30, 2, 11, generator=g).numpy()
    for agent in (stream, full):
        agent.reset(2)
    for t in range(30):
        rew = None if t == 0 else [1.0, 2.0]
        a, b = stream.act(obs[t], rew), full.act(obs[t], rew)
        assert a.shape == (2, 3)
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-5)
