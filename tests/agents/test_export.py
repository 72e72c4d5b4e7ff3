"""agents.export: the stream step as one ONNX / TorchScript graph, against the PyTorch stream agent.

The backbone is equivalence: checkpoints trained by the real trainer (``primal_dt.train.run``, a few
steps on the real Hopper HDF5 fixture) are exported, and the artefacts, run by onnxruntime
(``OnnxPolicy``) and TorchScript (``TorchScriptPolicy``), must give ``agents.Agent(engine="stream")``'s
actions to 1e-5 at every step of real Gymnasium Hopper-v5 episodes, at batch 1 and at batch 8 with
staggered restarts and rows leaving, for every kind of per-layer state (softmax KV cache, primal
running sums, windowed rings, linear-family prefix sums). All policies see the same observations and
rewards (the agent's actions drive the simulator), so the comparison is of the policies, not of
MuJoCo's sensitivity to 1e-7 action differences. The whole >= 500-step matrix is marked slow; the
default run plays shorter stretches of the same episodes.

Also: the metadata inside each artefact, the command line (one ``error:`` line for bad input), and
the layers that cannot be exported."""

from __future__ import annotations

import hashlib
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import gymnasium as gym
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from agents import dt_checkpoint, load_agent
from agents.export import (
    FORMATS,
    export_policy,
    main,
    read_metadata,
    semantics,
    stream_step,
)
from agents.onnx_policy import METADATA_KEY, OnnxPolicy
from agents.export import TorchScriptPolicy

TINY = ["preset=smoke", "progress=false", "model.d_model=32", "model.n_heads=2", "model.n_layers=3", "model.s=8",
        "K=5", "batch_size=8", "warmup_steps=5", "steps=20", "threads=1", "tensorboard=false", "eval.every=0",
        "eval.final_episodes=0", "log_every=10", "checkpoint_every=20"]
MODELS = {
    "dt": ["model=dt"],
    "primal+dt": ["model=primal+dt"],
    "primalformer-dt": ["model=primalformer-dt"],
    "windowed": ["model=primal+dt", "model.attention_options=primal.window=10,softmax.window=7"],
    "performer": ["model=performer"],
}
"""one trained model per kind of per-layer state: softmax ring cache, primal sums, windowed rings, linear family"""
EPISODE = 500
"""Hopper-v5 episodes last exactly this long here (see ``hopper``)"""


@pytest.fixture(scope="module")
def trained(hopper_file, tmp_path_factory):
    """name -> run directory of a checkpoint trained for a few steps by the real trainer."""
    from primal_dt.train import run

    out = tmp_path_factory.mktemp("runs")
    return {name: run([*TINY, *extra, f"data_source=d4rl:{hopper_file}", f"out={out / name}"])["run_dir"]
            for name, extra in MODELS.items()}


@pytest.fixture(scope="module")
def artefacts(trained, tmp_path_factory):
    """name -> (onnx path, torchscript path), exported once per module."""
    out = tmp_path_factory.mktemp("policies")
    return {name: (export_policy(run, "onnx", out / f"{name}.onnx"),
                   export_policy(run, "torchscript", out / f"{name}.pt")) for name, run in trained.items()}


def hopper():
    """Real Hopper-v5. ``terminate_when_unhealthy=False`` with a 500-step limit: every episode lasts
    exactly 500 steps whatever a barely trained policy does (it falls, and the simulation goes on), so
    the test covers long episodes of recurrent state, and the rows' restarts fall where the test puts
    them."""
    return gym.make("Hopper-v5", terminate_when_unhealthy=False, max_episode_steps=EPISODE)


def play(policies, batch: int, steps: int, restarts: dict[int, list[int]] | None = None,
         leave: dict[int, list[int]] | None = None):
    """Run ``steps`` environment steps of ``batch`` Hopper rows. ``policies[0]`` (the PyTorch agent)
    drives the simulators; every policy gets the same observations, previous rewards, restarts and
    departures. ``restarts``: {step: rows} cut mid-episode (reset_done before that step); rows also
    restart when their episode ends. ``leave``: {step: rows} dropped with keep_rows. Returns each
    policy's actions, one [rows, act_dim] array per step."""
    restarts, leave = restarts or {}, leave or {}
    envs = [hopper() for _ in range(batch)]
    seeds = iter(range(10_000))
    obs = np.stack([e.reset(seed=next(seeds))[0] for e in envs])
    for p in policies:
        p.reset(batch)
    rows = list(range(batch))  # which simulator each policy row is
    reward, done = None, np.zeros(batch, dtype=bool)
    actions = [[] for _ in policies]
    for t in range(steps):
        for r in restarts.get(t, []):
            done[rows.index(r)] = True
        if done.any():
            for i in np.flatnonzero(done):
                obs[i] = envs[rows[i]].reset(seed=next(seeds))[0]
            for p in policies:
                p.reset_done(done)
        if t in leave:
            keep = np.array([r not in leave[t] for r in rows])
            for p in policies:
                p.keep_rows(keep)
            rows = [r for r, k in zip(rows, keep) if k]
            obs, reward = obs[keep], None if reward is None else reward[keep]
        for out, p in zip(actions, policies):
            out.append(p.act(obs, reward))
        steps_out = [envs[r].step(a) for r, a in zip(rows, actions[0][-1])]
        obs = np.stack([s[0] for s in steps_out])
        reward = np.array([s[1] for s in steps_out], dtype=np.float32)
        done = np.array([s[2] or s[3] for s in steps_out])
    for e in envs:
        e.close()
    return actions


def policies(run_dir, paths):
    return [load_agent(run_dir, engine="stream", runtime="torch"), OnnxPolicy(paths[0]), TorchScriptPolicy(paths[1])]


def assert_same_actions(actions, names=("onnx", "torchscript")):
    ref = actions[0]
    assert len(ref) > 0
    for name, got in zip(names, actions[1:]):
        for t, (a, b) in enumerate(zip(ref, got)):
            assert a.shape == b.shape, (name, t)
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=0,
                                       err_msg=f"{name} differs from the stream agent at step {t}")


# -- exactness ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_exported_policies_act_as_the_stream_agent_batch_1(name, trained, artefacts):
    assert_same_actions(play(policies(trained[name], artefacts[name]), batch=1, steps=60))


@pytest.mark.parametrize("name", list(MODELS))
def test_exported_policies_act_as_the_stream_agent_batch_8_with_staggered_restarts(name, trained, artefacts):
    actions = play(policies(trained[name], artefacts[name]), batch=8, steps=70,
                   restarts={12 + 5 * r: [r] for r in range(1, 8)}, leave={60: [2, 5]})
    assert actions[0][-1].shape == (6, 3)
    assert_same_actions(actions)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_whole_hopper_episodes_batch_1(name, trained, artefacts):
    assert_same_actions(play(policies(trained[name], artefacts[name]), batch=1, steps=2 * EPISODE + 20))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_whole_hopper_episodes_batch_8_with_staggered_restarts(name, trained, artefacts):
    """Row r is cut at step 20 r + 15 (row 0 is not), then plays a whole 500-step episode, ends and
    restarts, all at different steps; two rows leave near the end."""
    actions = play(policies(trained[name], artefacts[name]), batch=8, steps=EPISODE + 180,
                   restarts={20 * r + 15: [r] for r in range(1, 8)}, leave={EPISODE + 170: [1, 6]})
    assert_same_actions(actions)


@pytest.mark.slow
def test_the_bookkeeping_inside_the_graph_is_the_agents(tiny_dt, dt_checkpoint_file, make_agent, tmp_path):
    """Return-to-go, per-row targets, rewards ignored at a row's first step, timesteps and the state
    normalisation, on a model made sensitive to them (a barely trained model hardly reads its
    return-to-go: a bookkeeping slip would move its actions by about 1e-5, too little to see)."""
    model = tiny_dt("primal+dt", options={"primal": {"s": 8, "window": 4}})
    with torch.no_grad():  # return and timestep embeddings on the scale of the state's (LayerNorm follows)
        for w in (model.embed_return.weight, model.embed_return.bias, model.embed_timestep.weight):
            w.normal_(0.0, 1.0)
        model.action_head[0].weight.mul_(5)
    path = dt_checkpoint_file(tmp_path, model)
    onnx_path, ts_path = export_policy(path, "onnx"), export_policy(path, "torchscript")
    g = np.random.default_rng(3)
    obs, rew = g.normal(size=(30, 3, 11)), g.uniform(0, 100, size=(30, 3)).astype(np.float32)

    def run(policy, rewards=True):
        policy.reset(3, target=[3600.0, 1000.0, 2500.0])
        out, reward = [], None
        for t in range(30):
            if t in (9, 17):
                row = np.arange(3) == (t % 3)
                policy.reset_done(row, target=500.0 * t)
                reward = reward.copy()
                reward[row] = 1e6  # the reward that ended an episode never reaches the next one
            out.append(policy.act(obs[t], reward if rewards else None))
            reward = rew[t]
        return np.stack(out)

    ref = run(make_agent(model, "stream"))
    assert np.abs(run(make_agent(model, "stream"), rewards=False) - ref).max() > 1e-3  # the test can see slips
    np.testing.assert_allclose(run(OnnxPolicy(onnx_path)), ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(run(TorchScriptPolicy(ts_path)), ref, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["linear", "cosformer", "kerformer", "flowformer", "primal+linear"])
def test_the_other_exportable_mechanisms_act_as_the_stream_agent(layout, tiny_dt, dt_checkpoint_file, make_agent,
                                                                  rollout_inputs, tmp_path):
    """The rest of the linear family (their export form is their recurrent step), on random inputs."""
    model = tiny_dt(layout)
    path = dt_checkpoint_file(tmp_path, model)
    obs, rew = rollout_inputs(T=16, B=3)
    resets = {7: np.array([False, True, False])}
    runs = []
    for policy in (make_agent(model, "stream"), OnnxPolicy(export_policy(path, "onnx")),
                   TorchScriptPolicy(export_policy(path, "torchscript"))):
        policy.reset(3)
        out, reward = [], None
        for t in range(16):
            if t in resets:
                policy.reset_done(resets[t])
            out.append(policy.act(obs[t], reward))
            reward = rew[t]
        runs.append(np.stack(out))
    for got in runs[1:]:
        np.testing.assert_allclose(got, runs[0], atol=1e-5, rtol=0)


def test_artefacts_hold_the_whole_step_with_no_python_side_state(trained, artefacts):
    """The same artefact runs two policies side by side with different batches: all state is in the
    tensors each runtime passes back."""
    a = OnnxPolicy(artefacts["windowed"][0])
    b = OnnxPolicy(artefacts["windowed"][0])
    ref = load_agent(trained["windowed"], runtime="torch")
    obs = np.random.default_rng(0).normal(size=(12, 3, 11)).astype(np.float32)
    a.reset(3), b.reset(1), ref.reset(3)
    for t in range(12):
        np.testing.assert_allclose(a.act(obs[t]), ref.act(obs[t]), atol=1e-5, rtol=0)
        b.act(obs[t, :1])
    np.testing.assert_allclose(b.act(obs[0, :1]), a.act(obs[0])[:1], atol=1e-5, rtol=0)


def onnx_session(model_or_path):
    source = model_or_path if isinstance(model_or_path, (str, Path)) else model_or_path.SerializeToString()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(source) if isinstance(source, Path) else source, opts,
                                providers=["CPUExecutionProvider"])


def graph_inputs(meta, B, g, reset, fill=0.0):
    """A feed for the ONNX step: random observations and rewards, every state tensor at ``fill``."""
    dtypes = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "bool": np.bool_}
    feed = {"observation": g.normal(size=(B, 11)).astype(np.float32), "reward": g.uniform(0, 3, B).astype(np.float32),
            "reset": reset, "target": np.full(B, 3600.0, np.float32)}
    for s in meta["state"]:
        dtype = dtypes[s["dtype"]]
        value = (fill != 0) if dtype is np.bool_ else (7 if dtype is np.int64 and fill else fill)
        feed["state." + s["name"]] = np.full([B, *s["shape"][1:]], value, dtype)
    return feed


def test_a_restarted_row_acts_as_a_fresh_one_whatever_its_state_held(artefacts):
    """The graph zeroes a restarted row's state: NaN in what is zeroed, any finite values in a softmax ring's
    keys and values (their zeroed validity flags hide them) give the actions and state of a fresh row."""
    path = artefacts["windowed"][0]
    sess, meta = onnx_session(path), read_metadata(path)
    masked = {s["name"] for s in meta["state"] if s.get("masked_by")}
    assert masked == {f"layer{i}.{x}" for i in (0, 1) for x in "kv"}  # softmax, softmax, windowed primal
    dirty = graph_inputs(meta, 3, np.random.default_rng(0), np.ones(3, bool), fill=np.nan)
    for name in masked:
        dirty["state." + name][:] = 7.0
    fresh = graph_inputs(meta, 3, np.random.default_rng(0), np.zeros(3, bool))
    assert np.isnan(dirty["state.layer2.ring"]).all() and dirty["state.t"].tolist() == [7, 7, 7]
    names = ["action", *(s["name"] for s in meta["state"])]
    got = dict(zip(names, sess.run(None, dirty)))
    want = dict(zip(names, sess.run(None, fresh)))
    for name in names:
        if name in masked:  # equal where the ring holds anything (the slots written at this step)
            valid = want[meta_flag(meta, name)].astype(bool)
            np.testing.assert_array_equal(got[name].transpose(0, 2, 1, 3)[valid], want[name].transpose(0, 2, 1, 3)[valid])
        else:
            np.testing.assert_array_equal(got[name], want[name])


def meta_flag(meta, name: str) -> str:
    return next(s["masked_by"] for s in meta["state"] if s["name"] == name)


# -- metadata -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_metadata_describes_the_graph_and_its_source(fmt, trained, artefacts):
    path = artefacts["windowed"][list(FORMATS).index(fmt)]
    meta = read_metadata(path)
    ck_file = dt_checkpoint.resolve(trained["windowed"])
    ck = dt_checkpoint.load(ck_file)
    assert meta["checkpoint_sha256"] == hashlib.sha256(ck_file.read_bytes()).hexdigest()
    assert meta["package_version"] == version("primal-dt") and meta["artefact"] == fmt
    assert (meta["obs_dim"], meta["act_dim"]) == (11, 3)
    assert meta["targets"] == list(ck.data.eval_targets) and meta["default_target"] == ck.data.eval_targets[0]
    assert meta["reward_scale"] == ck.data.reward_scale and meta["layers"] == ["softmax", "softmax", "primal"]
    step = stream_step(ck.build_model(), ck.data)
    assert meta["semantics"] == semantics(step) and "reset" in meta["semantics"]
    assert "the chunk (a_{t-1}, R_t, s_t)" in meta["semantics"] and "the last 14 tokens" in meta["semantics"]  # K = 5
    assert [s["name"] for s in meta["state"]] == [s.name for s in step.specs]
    assert meta["state"][:3] == [
        {"name": "t", "shape": ["batch"], "dtype": "int64", "initial": 0, "what": "timestep of the row's episode"},
        {"name": "rtg", "shape": ["batch"], "dtype": "float32", "initial": 0,
         "what": "return-to-go R_t / reward_scale"},
        {"name": "prev_action", "shape": ["batch", 3], "dtype": "float32", "initial": 0,
         "what": "the action of the previous step (a_{t-1})"}]
    by_name = {s["name"]: s for s in meta["state"]}
    # windowed primal (layer 2): a ring of its 10 positions and their float64 sum; softmax (window 7): a ring of
    # 7 + 3 - 1 key/value slots (the step's three tokens) and its phase
    assert by_name["layer2.ring"]["shape"] == ["batch", 10, 64] and by_name["layer2.S"]["dtype"] == "float64"
    assert by_name["layer0.k"]["shape"] == ["batch", 2, 9, 16] and by_name["layer0.valid"]["dtype"] == "bool"
    assert by_name["layer0.pos"]["shape"] == ["batch"] and by_name["layer0.pos"]["dtype"] == "int64"
    if fmt == "onnx":  # the graph's own inputs say the same
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in sess.get_inputs()}
        types = {"float32": "tensor(float)", "float64": "tensor(double)", "int64": "tensor(int64)",
                 "bool": "tensor(bool)"}
        for s in meta["state"]:
            i = inputs["state." + s["name"]]
            assert i.shape == s["shape"] and i.type == types[s["dtype"]], s
        assert inputs["observation"].shape == ["batch", 11] and inputs["reset"].type == "tensor(bool)"
        assert sess.get_modelmeta().custom_metadata_map[METADATA_KEY]


@pytest.mark.parametrize("name", ["dt", "windowed"])
def test_each_softmax_ring_write_is_one_scatternd_operator(name, artefacts):
    """The export writes each softmax layer's keys and its values with one ScatterND (agents.ring_writes): the
    form's own write exports as a ScatterElements, which reads an index per value (slower at large batches),
    and an indexed assignment as a dozen broadcasting operators."""
    path = artefacts[name][0]
    ops = Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    assert ops["ScatterND"] == 2 * read_metadata(path)["layers"].count("softmax") > 0


@pytest.mark.slow
def test_a_checkpoint_in_memory_exports_with_no_file_hash(trained, tmp_path):
    ck = dt_checkpoint.load(trained["dt"])
    path = export_policy(ck, "onnx", tmp_path / "p.onnx")
    assert read_metadata(path)["checkpoint_sha256"] is None
    with pytest.raises(ValueError, match="out=PATH is required"):
        export_policy(ck, "onnx")


# -- what cannot be exported ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["kernel-rbf-asym", "svr-bn"])
def test_a_layer_whose_cache_grows_is_named_with_its_index(kind, tiny_dt, dt_checkpoint_file, tmp_path):
    model = tiny_dt(layers=("softmax", kind, "primal"), options={"primal": {"s": 8}})
    path = dt_checkpoint_file(tmp_path, model)
    with pytest.raises(ValueError, match=rf"layer 1 \({kind}\): .*cache of every token.*grows with the episode"):
        export_policy(path, "onnx", tmp_path / "p.onnx")
    assert not (tmp_path / "p.onnx").exists()


def test_a_post_norm_block_is_named(tiny_dt):
    model = tiny_dt("primal+dt")
    model.stack.blocks[2].norm = "post"
    with pytest.raises(ValueError, match=r"layer 2 \(primal\): a post-norm block"):
        stream_step(model, dt_checkpoint.DataInfo("hopper-medium", np.zeros(11), np.ones(11), 1000.0))


# -- the command line ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_command_line_exports_next_to_the_checkpoint(trained, run_cli, tmp_path):
    proc = run_cli("agents.export", f"checkpoint={trained['primal+dt']}", "format=onnx")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dt_checkpoint.resolve(trained["primal+dt"]).parent / FORMATS["onnx"]
    assert str(out) in proc.stdout and "Traceback" not in proc.stderr
    pol = OnnxPolicy(out)
    pol.reset(2)
    assert pol.act(np.zeros((2, 11))).shape == (2, 3)


@pytest.mark.slow
def test_a_failed_write_is_one_error_line_and_leaves_nothing(trained, run_cli, one_line_error, tmp_path):
    out = tmp_path / "p.onnx"
    proc = run_cli("agents.export", f"checkpoint={trained['dt']}", f"out={out}", file_size=50_000)
    one_line_error(proc, f"could not write the exported onnx policy {out}", "file too large", status=1)
    assert list(tmp_path.iterdir()) == []


def test_command_line_bad_input_is_one_error_line(tiny_dt, dt_checkpoint_file, run_cli, one_line_error, tmp_path):
    path = dt_checkpoint_file(tmp_path, tiny_dt(layers=("softmax", "kernel-linear-sym", "primal")))
    one_line_error(run_cli("agents.export", f"checkpoint={path}", f"out={tmp_path / 'p.onnx'}"),
                   "layer 1 (kernel-linear-sym)", "cannot be exported")


@pytest.mark.parametrize("args, message", [
    ([], "checkpoint=PATH is required"),
    (["checkpoint={ck}", "format=tflite"], "'tflite'"),  # tyro's message: the names it accepts
    (["checkpoint={dir}/missing.pt"], "does not exist"),
    (["checkpoint={ck}", "out={ck}", "overwrite=true"], "is the checkpoint being exported"),
    (["checkpoint={ck}", "out={dir}/taken.onnx"], "exists; choose another path, or pass overwrite=true"),
    (["checkpoint={ck}", "out={dir}"], "is a directory"),
    (["checkpoint={ck}", "out={dir}/policy.pt"], "ends .pt, but a format=onnx export is a .onnx file: name it policy.onnx"),
    (["checkpoint={ck}", "format=torchscript", "out={dir}/p.onnx"], "is a .pt file: name it p.pt"),
])
def test_bad_command_lines_end_with_one_error_line(args, message, trained, tmp_path, capsys):
    ck = dt_checkpoint.resolve(trained["dt"])
    (tmp_path / "taken.onnx").write_text("an earlier file")
    argv = [a.format(ck=ck, dir=tmp_path) for a in args]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err
    assert (tmp_path / "taken.onnx").read_text() == "an earlier file"


def test_overwrite_replaces_an_earlier_export(trained, tmp_path):
    out = tmp_path / "p.pt"
    out.write_text("old")
    main([f"checkpoint={trained['dt']}", "format=torchscript", f"out={out}", "overwrite=true"])
    assert read_metadata(out)["artefact"] == "torchscript"
    assert not list(tmp_path.glob(".p.pt.*.tmp"))


def test_two_exports_to_one_out_started_together_one_wins_and_the_other_is_refused(trained, tmp_path):
    """Two ``python -m agents.export`` to the same new ``out``, as two real processes: both find ``out`` free
    before they export, yet only one file is written and the other command is refused in one line."""
    import os
    import subprocess
    import sys

    out = tmp_path / "p.pt"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    argv = [sys.executable, "-m", "agents.export", f"checkpoint={trained['dt']}", "format=torchscript", f"out={out}"]
    procs = [subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    done = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert sorted(code for code, _, _ in done) == [0, 2], done
    (_, _, err), = [d for d in done if d[0] == 2]
    assert f"error: out={out} exists" in err and "Traceback" not in err
    assert read_metadata(out)["artefact"] == "torchscript" and sorted(tmp_path.iterdir()) == [out]


def test_an_out_written_between_the_check_and_the_write_is_kept(trained, tmp_path, monkeypatch):
    """The interleaving that two exports can meet, made deterministic: ``out`` appears after the export found it
    free and before it writes (the other export's write); it is kept, and this one is refused."""
    from agents import export

    out = tmp_path / "p.pt"
    real = export.ck_io.remove_stale_temps

    def other_export_finishes(*args, **kw):  # called after the check, just before the write
        out.write_text("the other export")
        return real(*args, **kw)

    monkeypatch.setattr(export.ck_io, "remove_stale_temps", other_export_finishes)
    with pytest.raises(ValueError, match=f"out={out} exists"):
        export_policy(trained["dt"], "torchscript", out)
    assert out.read_text() == "the other export" and sorted(tmp_path.iterdir()) == [out]


def test_the_exported_step_is_the_same_function_at_any_batch(trained):
    """The model's step (DTStep) in PyTorch (what both formats trace): rows are independent, so a row computed alone
    equals the same row inside a batch, and reset rows equal fresh ones."""
    ck = dt_checkpoint.load(trained["windowed"])
    step = stream_step(ck.build_model(), ck.data)
    g = torch.Generator().manual_seed(0)
    state, single = step.init(3).flat(), step.init(1).flat()
    for t in range(8):
        obs, rew = torch.randn(3, 11, generator=g), torch.rand(3, generator=g)
        reset = torch.tensor([t == 0, t == 5, False]) if t else torch.ones(3, dtype=torch.bool)
        target = torch.full((3,), 3600.0)
        with torch.no_grad():
            a, *state = step(obs, rew, reset, target, *state)
            b, *single = step(obs[2:], rew[2:], reset[2:], target[2:], *single)
        torch.testing.assert_close(a[2:], b, atol=1e-6, rtol=0)
    assert state[0].tolist() == [8, 3, 8]  # timesteps: row 1 restarted at t = 5


@pytest.mark.slow
def test_a_killed_exports_temporary_file_is_swept_at_the_next_export_there(trained, killed_checkpoint_write,
                                                                           tmp_path):
    out = tmp_path / "p.onnx"
    stale = killed_checkpoint_write(out)  # the same atomic writer, killed before its rename
    export_policy(trained["dt"], "onnx", out)
    assert not stale.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["p.onnx"]


# -- load_agent(runtime="onnx") -------------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The user's cache directory (``XDG_CACHE_HOME``), empty, and where load_agent keeps exports in it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return tmp_path / "xdg-cache" / "primal-dt" / "onnx"


def run_copy(trained, name, directory) -> Path:
    """A run directory holding a copy of ``trained[name]``'s checkpoint; returns the checkpoint file."""
    import shutil

    directory.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(Path(trained[name]) / "last.pt", directory / "last.pt"))


def negated_late(real: Path, out: Path, late: int = 12) -> Path:
    """A graph that is ``real`` (its metadata included, the checkpoint hash too) up to a row's step ``late``
    and negates the action from then on: what a planted file can do that a few checked steps cannot see."""
    from onnx import TensorProto, helper

    m = onnx.load(str(real))
    for node in m.graph.node:
        node.output[:] = ["action_raw" if o == "action" else o for o in node.output]
    m.graph.node.extend([
        helper.make_node("Constant", [], ["late_t"], value=helper.make_tensor("v", TensorProto.INT64, [], [late])),
        helper.make_node("Constant", [], ["axis1"], value=helper.make_tensor("a", TensorProto.INT64, [1], [1])),
        helper.make_node("GreaterOrEqual", ["state.t", "late_t"], ["is_late"]),
        helper.make_node("Unsqueeze", ["is_late", "axis1"], ["is_late_col"]),
        helper.make_node("Neg", ["action_raw"], ["negated"]),
        helper.make_node("Where", ["is_late_col", "negated", "action_raw"], ["action"]),
    ])
    onnx.save(m, str(out))
    return out


def test_the_onnx_runtime_agent_acts_as_the_torch_agent_from_an_export_cached_in_the_users_cache(
        trained, tmp_path, cache, capsys):
    """``load_agent(runtime="onnx")`` exports the checkpoint once into the user's cache (named by the checkpoint's
    hash, its graph's digest beside it), reuses it, writes nothing into the run directory and acts as the torch
    agent does, target included. The default runtime ("auto") is that export, and says so; a checkpoint in
    memory (no file to key the cache by) and a request only torch computes exactly get the torch agent."""
    ck = run_copy(trained, "primal+dt", tmp_path / "run")
    fast = load_agent(ck.parent, runtime="onnx", target=1800.0)
    assert isinstance(fast, OnnxPolicy) and fast.default_target == 1800.0 and fast.info.env == "hopper-medium"
    assert sorted(p.name for p in ck.parent.iterdir()) == ["last.pt"]
    (graph,) = cache.glob("*.onnx")
    sha = hashlib.sha256(ck.read_bytes()).hexdigest()
    assert graph.name.startswith(sha) and read_metadata(graph)["checkpoint_sha256"] == sha
    assert (cache / (graph.name + ".sha256")).read_text().strip() == hashlib.sha256(graph.read_bytes()).hexdigest()
    assert cache.stat().st_mode & 0o777 == 0o700
    stamp = graph.stat().st_mtime_ns
    again = load_agent(ck, target=1800.0)
    assert again.runtime == "onnx" and "load_agent: runtime=onnx" in capsys.readouterr().err
    assert graph.stat().st_mtime_ns == stamp and sorted(cache.iterdir()) == sorted(graph.parent.glob(f"{sha}*"))
    ref = load_agent(ck, target=1800.0, runtime="torch")
    for source, kw in ((torch.load(ck, weights_only=True), {}), (ck, {"engine": "recompute"})):
        assert load_agent(source, target=1800.0, **kw).runtime == "torch"
        assert "load_agent: runtime=torch" in capsys.readouterr().err
    obs = np.random.default_rng(3).normal(size=(20, 3, 11)).astype(np.float32)
    for p in (fast, again, ref):
        p.reset(3)
    reward = None
    for t in range(20):
        a = ref.act(obs[t], reward)
        np.testing.assert_allclose(fast.act(obs[t], reward), a, atol=1e-5, rtol=0)
        np.testing.assert_allclose(again.act(obs[t], reward), a, atol=1e-5, rtol=0)
        reward = np.ones(3, np.float32)


def test_a_graph_cached_by_other_code_is_never_what_acts(trained, tmp_path, cache):
    """The package's version stays the same between development commits, so a cache entry is also named by the
    digest of the package's source: a graph an older exporter filed for the same checkpoint (an older, slower graph)
    is not reused; the current code's export is filed beside it and acts."""
    from agents.export import source_digest

    ck = run_copy(trained, "dt", tmp_path / "run")
    load_agent(ck, runtime="onnx")
    (graph,) = cache.glob("*.onnx")
    digest = source_digest()[:16]
    assert digest in graph.name
    older = [p.rename(p.with_name(p.name.replace(digest, "0" * 16))) for p in sorted(cache.iterdir())]  # as filed
    load_agent(ck, runtime="onnx")  # by the same version's other code
    assert sorted(cache.iterdir()) == sorted([graph, graph.with_name(graph.name + ".sha256"), *older])


def test_a_planted_policy_file_is_never_what_acts(trained, tmp_path, cache):
    """A graph carrying the checkpoint's own metadata (its hash too) that negates actions from step 12 on passes
    the few steps load_agent checks; planted beside the checkpoint it is never read, and written over the cache
    entry its digest no longer matches: the real export acts, equal to the torch agent over a real Hopper episode."""
    from agents.agent import checked

    ck = run_copy(trained, "dt", tmp_path / "run")
    real = export_policy(ck, "onnx", tmp_path / "real.onnx")
    planted = negated_late(real, ck.parent / "policy.onnx")
    assert read_metadata(planted) == read_metadata(real)
    torch_agent = load_agent(ck, runtime="torch")
    checked(OnnxPolicy(planted), torch_agent)  # what the run directory's file alone would have passed
    before = planted.read_bytes()

    def acts_as_torch(policy):
        assert_same_actions(play([load_agent(ck, runtime="torch"), policy], batch=1, steps=40), names=("onnx",))

    with pytest.raises(AssertionError):  # the plant deviates once its episode is long enough
        acts_as_torch(OnnxPolicy(planted))
    acts_as_torch(load_agent(ck.parent, runtime="onnx"))  # beside the checkpoint: never read
    assert planted.read_bytes() == before
    (graph,) = cache.glob("*.onnx")
    graph.write_bytes(before)  # the cache entry replaced, its recorded digest left as it was
    acts_as_torch(load_agent(ck, runtime="onnx"))
    assert hashlib.sha256(graph.read_bytes()).hexdigest() == (cache / (graph.name + ".sha256")).read_text().strip()
    assert graph.read_bytes() != before


def test_a_checkpoint_replaced_while_it_is_exported_never_files_its_graph_under_the_replaced_ones_hash(
        trained, tmp_path, cache, monkeypatch):
    """Whoever can write the run directory swaps the checkpoint after its hash is taken and back after the export
    read it: the cache entry named by the real checkpoint's hash must still be the real checkpoint's graph (before,
    the export read the swapped file, and every later load of the real checkpoint acted as the other one)."""
    import agents.agent as agent_module
    import agents.export as export_module

    ck = run_copy(trained, "dt", tmp_path / "run")
    real, other = ck.read_bytes(), (Path(trained["primal+dt"]) / "last.pt").read_bytes()
    export = export_module.export_policy

    def swapped_during_export(*args, **kw):
        ck.write_bytes(other)
        try:
            return export(*args, **kw)
        finally:
            ck.write_bytes(real)

    monkeypatch.setattr(export_module, "export_policy", swapped_during_export)
    graph = agent_module.cached_export(ck)
    assert graph is not None and graph.name.startswith(hashlib.sha256(real).hexdigest())
    assert_same_actions(play([load_agent(ck, runtime="torch"), OnnxPolicy(graph)], batch=2, steps=15), names=("onnx",))


@pytest.mark.slow
def test_a_read_only_run_leaves_no_temporary_export_behind(trained, tmp_path, cache, monkeypatch):
    """Exports go to the cache, or, when there is none (the cache path is a file), to a temporary directory that
    is gone once onnxruntime has read the graph: nothing is left in the temporary directory either way."""
    import tempfile

    ck = run_copy(trained, "dt", tmp_path / "run")
    ck.parent.chmod(0o555)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    try:
        load_agent(ck.parent, runtime="onnx")
        assert list(tmp.iterdir()) == [] and len(list(cache.glob("*.onnx"))) == 1
        (tmp_path / "not-a-dir").write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
        policy = load_agent(ck.parent, runtime="onnx")
        policy.reset(1)
        assert list(tmp.iterdir()) == [] and policy.act(np.zeros((1, 11), np.float32), None).shape == (1, 3)
    finally:
        ck.parent.chmod(0o755)
    assert sorted(p.name for p in ck.parent.iterdir()) == ["last.pt"]


@pytest.mark.parametrize("kw, message", [
    ({"runtime": "tensorrt"}, "unknown runtime 'tensorrt'; choose one of auto, torch, onnx"),
    ({"runtime": "onnx", "engine": "recompute"}, "runtime='onnx' runs the exact stream step on the CPU"),
])
def test_onnx_runtime_errors(trained, kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_agent(trained["dt"], **kw)


def test_the_export_command_runs_once_as_main(run_cli):
    """``agents`` used to import ``agents.export`` at package import, so ``python -m agents.export`` ran the module
    twice and printed runpy's RuntimeWarning before every export."""
    proc = run_cli("agents.export", "--help")
    assert proc.returncode == 0 and "checkpoint" in proc.stdout, proc.stderr[-2000:]
    assert "RuntimeWarning" not in proc.stderr and "found in sys.modules" not in proc.stderr, proc.stderr
