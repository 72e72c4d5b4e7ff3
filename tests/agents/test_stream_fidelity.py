"""What streams is what was trained: a checkpoint trained stream-exact acts identically by both engines in
the real simulator; one trained on K-step segments does not, and every output says which policy it measured.

The checkpoints are trained by the real trainer (a few dozen steps of a tiny model on the bundled replica),
not drawn at random: exactness must hold for the weights training produces."""

import json
import warnings

import gymnasium as gym
import numpy as np
import pytest

from agents import load_agent
from agents.agent import StreamNotTrainedWarning
from primal_dt.train import run as train

W = 7  # tokens per layer's window: 2 layers reach 12 tokens back, so K=10 counts steps 4..9 of a segment
LAYOUTS = ["dt", "primal+dt", "primalformer-dt"]


def _train(out, model, *extra):
    train([f"out={out}", "env=hopper-medium", f"model={model}", "model.d_model=32", "model.n_heads=2",
           "model.n_layers=2", "model.s=8", "K=10", "batch_size=16", "steps=40", "warmup_steps=5", "lr=1e-3",
           "eval.every=0", "eval.final_episodes=0", "val_fraction=0", "checkpoint_every=0", "progress=false",
           "tensorboard=false", "threads=1", *extra])
    (run,) = (out / "hopper-medium" / model).iterdir()
    return run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """layout -> run directory trained stream-exact; "segments" -> a primal+dt run trained on K-step segments;
    "from_start" -> a primalformer-dt run trained on episode prefixes."""
    root = tmp_path_factory.mktemp("fidelity")
    runs = {m: _train(root / m, m, f"stream_window={W}") for m in LAYOUTS}
    runs["segments"] = _train(root / "segments", "primal+dt", "eval.final_episodes=2", "eval.max_steps=30",
                              "eval.num_envs=2")
    # episode prefixes: K = max_timestep = 40 steps from each episode's first (play's episodes stay shorter)
    runs["from_start"] = _train(root / "from_start", "primalformer-dt", "from_start=true", "K=40", "max_timestep=40",
                                "batch_size=4")
    return runs


def play(stream, recompute, T=150, seeds=(3, 4)):
    """Both agents act for two real Hopper episodes (rows) on the stream agent's trajectory, row 0 restarting
    at T // 2; the largest action difference."""
    sims = [gym.make("Hopper-v4", terminate_when_unhealthy=False) for _ in seeds]
    obs = np.stack([e.reset(seed=s)[0] for e, s in zip(sims, seeds)])
    for a in (stream, recompute):
        a.reset(len(seeds))
    worst, reward = 0.0, None
    for t in range(T):
        if t == T // 2:
            done = np.array([True, False])
            obs[0] = sims[0].reset(seed=99)[0]
            for a in (stream, recompute):
                a.reset_done(done)
        act = stream.act(obs, reward)
        worst = max(worst, float(np.abs(act - recompute.act(obs, reward)).max()))
        steps = [e.step(a) for e, a in zip(sims, act)]
        obs = np.stack([s[0] for s in steps])
        reward = np.array([s[1] for s in steps], dtype=np.float32)
    for e in sims:
        e.close()
    return worst


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_stream_exact_checkpoint_streams_its_recompute_policy_in_hopper(layout, trained):
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamNotTrainedWarning)  # an exact stream is not warned about
        stream = load_agent(trained[layout], engine="stream", runtime="torch")
    recompute = load_agent(trained[layout], engine="recompute")
    assert stream.fidelity == {"engine": "stream", "exact": True, "stream_window": W, "from_start": False, "whole_episodes": False}
    assert recompute.fidelity == {"engine": "recompute", "exact": True, "stream_window": W, "from_start": False, "whole_episodes": False}
    assert play(stream, recompute) <= 1e-5


def test_a_checkpoint_trained_on_episode_prefixes_streams_its_recompute_policy_in_hopper(trained):
    """from_start=true: no window, every layer over the whole episode so far, and still the trained policy."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamNotTrainedWarning)
        stream = load_agent(trained["from_start"], engine="stream", runtime="torch")
    recompute = load_agent(trained["from_start"], engine="recompute")
    assert stream.fidelity == {"engine": "stream", "exact": True, "stream_window": 0, "from_start": True, "whole_episodes": False}
    assert play(stream, recompute, T=40) <= 1e-5  # every step of both rows within K (row 0 restarts at 20)


@pytest.mark.parametrize("config, streams", [
    ({}, ""), ({"stream_window": 0}, ""), ({"stream_window": 21}, "stream_window=21"),
    ({"from_start": True}, "from_start=true"), ({"whole_episodes": True}, "whole_episodes=true"),
    ({"stream_window": True}, ""),  # a bool is no window (a damaged config is not a stream-trained run)
])
def test_a_run_trained_for_the_stream_is_evaluated_by_it_unless_told_otherwise(config, streams, tmp_path):
    """``trained_for_stream`` names the option that made a run's stream its policy; the trainer's evaluation takes
    the stream then (listing that option as what set eval.engine), recompute otherwise, and a given engine wins."""
    from agents import train_config
    from agents.stream_training import trained_for_stream

    assert trained_for_stream(config) == streams
    argv = [f"{k}={str(v).lower()}" for k, v in config.items() if not isinstance(v, bool) or k != "stream_window"]
    argv += ["K=1000"] * bool(config.get("from_start"))
    built = train_config.build(["env=hopper-medium", *argv])
    assert (built.cfg.eval.engine, built.provenance["eval.engine"]) == (
        ("stream", streams) if streams else ("recompute", "default"))
    told = train_config.build(["env=hopper-medium", *argv, "eval.engine=recompute"])
    assert told.cfg.eval.engine == "recompute"


def test_a_checkpoint_trained_on_segments_streams_another_policy_and_says_so(trained):
    with pytest.warns(StreamNotTrainedWarning, match="stream_window=W") as caught:
        stream = load_agent(trained["segments"], engine="stream", runtime="torch")
    assert len(caught) == 1
    assert stream.fidelity == {"engine": "stream", "exact": False, "stream_window": 0, "from_start": False, "whole_episodes": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamNotTrainedWarning)
        recompute = load_agent(trained["segments"], engine="recompute")
    assert recompute.fidelity["exact"] is True
    assert play(stream, recompute) > 1e-3  # why the flag exists: the two engines are different policies


@pytest.mark.slow
def test_the_exported_policy_records_whether_its_stream_is_exact(trained, tmp_path):
    pytest.importorskip("onnxruntime")
    from agents.export import export_policy
    from agents.onnx_policy import OnnxPolicy

    for key, exact, window, start in (("dt", True, W, False), ("segments", False, 0, False),
                                      ("from_start", True, 0, True)):
        path = export_policy(trained[key] / "last.pt", "onnx", tmp_path / f"{key}.onnx")
        assert OnnxPolicy(path).fidelity == {"engine": "stream", "exact": exact, "stream_window": window,
                                             "from_start": start, "whole_episodes": False}


def test_rollout_and_report_name_the_engine_and_whether_it_is_the_trained_policy(trained, run_cli, tmp_path):
    run = trained["segments"]
    args = ("episodes=2", "max_steps=30", "num_envs=2", "progress=false", "threads=1")
    stream = run_cli("eval.rollout", f"checkpoint={run}", "engine=stream", *args)
    assert stream.returncode == 0, stream.stderr
    assert [ln for ln in stream.stdout.splitlines() if ln.startswith("note:")] == [
        next(ln for ln in stream.stdout.splitlines() if "is trained on K-step segments" in ln)]
    assert "NOT the trained policy" in stream.stdout
    rec = run_cli("eval.rollout", f"checkpoint={run}", "engine=recompute", *args)
    assert rec.returncode == 0, rec.stderr
    assert "note:" not in rec.stdout and "(the trained policy)" in rec.stdout
    reports = {e: json.loads((run / f"rollout-{e}.json").read_text()) for e in ("stream", "recompute")}
    assert {e: (r["engine"], r["exact"], r["stream_window"]) for e, r in reports.items()} == {
        "stream": ("stream", False, 0), "recompute": ("recompute", True, 0)}
    exact = run_cli("eval.rollout", f"checkpoint={trained['dt']}", "engine=stream", *args)
    assert exact.returncode == 0 and "note:" not in exact.stdout and "(the trained policy)" in exact.stdout

    # eval.report: the training's own final evaluation (recompute) and the stream rollout are rows of their
    # own, each naming its engine; the recompute rollout repeats the run's own engine and is left out, named
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["engine"], summary["exact"], summary["stream_window"]) == ("recompute", True, 0)
    rep = run_cli("eval.report", str(run), f"out={tmp_path / 'report'}")
    assert rep.returncode == 0, rep.stderr
    md = (tmp_path / "report" / "scores.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| hopper-medium")]
    engines = sorted(ln.split("|")[4].strip() for ln in rows)
    assert engines == ["recompute", "recompute", "stream (not trained)", "stream (not trained)"]  # 2 targets each
    assert "rollout-recompute.json: the run's own final evaluation is by this engine, left out" in md


def test_an_exported_stream_says_when_it_is_not_the_trained_policy_and_how_to_get_one(trained, tmp_path, run_cli):
    """``agents.export`` prints one note, and ``OnnxPolicy`` / ``TorchScriptPolicy`` warn once, for a graph of a
    segment-trained checkpoint; an exact one is exported and loaded without a word. ``load_agent`` says it once."""
    from agents.export import TorchScriptPolicy
    from agents.onnx_policy import OnnxPolicy

    for name, exact in (("segments", False), ("primal+dt", True)):
        for fmt, runtime in (("onnx", OnnxPolicy), ("torchscript", TorchScriptPolicy)):
            out = tmp_path / f"{name}-{fmt}.policy"
            p = run_cli("agents.export", f"checkpoint={trained[name]}", f"format={fmt}", f"out={out}")
            assert p.returncode == 0, p.stderr[-2000:]
            notes = [x for x in p.stdout.splitlines() if x.startswith("note:")]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                policy = runtime(out)
            said = [w for w in caught if issubclass(w.category, StreamNotTrainedWarning)]
            assert policy.fidelity["exact"] is exact
            if exact:
                assert notes == [] and said == []
                continue
            assert len(notes) == 1 and f"{out} streams a checkpoint trained on K-step segments" in notes[0]
            assert "stream_window=W" in notes[0] and "from_start=true" in notes[0]
            assert len(said) == 1 and "stream_window=W" in str(said[0].message)
            assert said[0].filename == __file__  # pointing at the line that built the runtime
    with pytest.warns(StreamNotTrainedWarning) as caught:
        load_agent(trained["segments"], engine="stream", runtime="onnx")
    assert len([w for w in caught if issubclass(w.category, StreamNotTrainedWarning)]) == 1
