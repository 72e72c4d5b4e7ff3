"""agents/onnx_policy.py: the one-file runtime of an exported policy (numpy + onnxruntime only).

It must work copied out of the package, in a process where torch cannot be imported; act as the
PyTorch stream agent does through restarts and departing rows; and turn a caller's mistake (wrong
observation shape, dtype or batch, a file that is not a policy) into a clear error. The same checks
hold for ``agents.export.TorchScriptPolicy`` and the torch ``agents.Agent``, which share its
bookkeeping (``Policy``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import json

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import agents.onnx_policy as onnx_policy
from agents import load_agent
from agents.export import export_policy
from agents.onnx_policy import OnnxPolicy
from agents.export import TorchScriptPolicy

BLOCKER = '''\
import sys

class Blocked:
    """No torch, and nothing of primal-dt: what a deployment machine without them has."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "primal_dt", "agents", "envs", "eval"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, Blocked())
'''


@pytest.fixture(scope="module")
def exported(tiny_dt, dt_checkpoint_file, tmp_path_factory):
    """(model, onnx path, torchscript path) of a small primal+dt whose softmax layers stream a window."""
    d = tmp_path_factory.mktemp("policy")
    model = tiny_dt("primal+dt", K=4, options={"primal": {"s": 8}, "softmax": {"window": 5}})
    ck = dt_checkpoint_file(d, model)
    return model, export_policy(ck, "onnx", d / "policy.onnx"), export_policy(ck, "torchscript", d / "policy.pt")


GRAPHS = {"onnx": lambda e: OnnxPolicy(e[1]), "torchscript": lambda e: TorchScriptPolicy(e[2])}
RUNTIMES = {**GRAPHS, "agent": lambda e: load_agent(e[1].parent, runtime="torch")}
"""every implementation of the acting API (``agents.onnx_policy.Policy``): its checks are one code"""


def play(policy, obs, rew, events):
    """Actions for obs [T, B, 11] with the previous step's rewards; ``events``: {t: (method, mask)}."""
    policy.reset(obs.shape[1])
    out, reward, rows = [], None, np.arange(obs.shape[1])
    for t in range(obs.shape[0]):
        if t in events:
            method, mask = events[t]
            getattr(policy, method)(mask)
            if method == "keep_rows":
                rows = rows[mask]
                reward = reward[mask]
        out.append(policy.act(obs[t, rows], reward))
        reward = rew[t, rows]
    return out


def test_runs_copied_out_of_the_package_where_torch_cannot_be_imported(exported, make_agent, tmp_path):
    model, onnx_path, _ = exported
    lib = tmp_path / "deploy"
    lib.mkdir()
    shutil.copy(onnx_policy.__file__, lib / "onnx_policy.py")
    shutil.copy(onnx_path, lib / "policy.onnx")
    (lib / "sitecustomize.py").write_text(BLOCKER)
    g = np.random.default_rng(0)
    obs, rew = g.normal(size=(20, 2, 11)), g.uniform(0, 3, size=(20, 2))
    np.save(lib / "obs.npy", obs), np.save(lib / "rew.npy", rew)
    code = """
import sys
import numpy as np
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("torch was importable")
from onnx_policy import OnnxPolicy
policy = OnnxPolicy("policy.onnx")
policy.reset(2)
obs, rew = np.load("obs.npy"), np.load("rew.npy")
out, reward = [], None
for t in range(len(obs)):
    if t == 7:
        policy.reset_done(np.array([False, True]))
    out.append(policy.act(obs[t], reward))
    reward = rew[t]
np.save("actions.npy", np.stack(out))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "primal_dt", "agents", "envs", "eval"))
assert not loaded, loaded
print("ran", policy.metadata["layers"])
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(lib), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=lib, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ran ['softmax', 'softmax', 'primal']" in proc.stdout
    ref = make_agent(model, "stream")
    expected = play(ref, obs.astype(np.float32), rew.astype(np.float32), {7: ("reset_done", np.array([False, True]))})
    np.testing.assert_allclose(np.load(lib / "actions.npy"), np.stack(expected), atol=1e-5, rtol=0)


@pytest.mark.parametrize("runtime", list(GRAPHS))
def test_restarts_and_departing_rows_as_the_agent(runtime, exported, make_agent, rollout_inputs):
    model = exported[0]
    obs, rew = rollout_inputs(T=24, B=4)
    events = {6: ("reset_done", np.array([True, False, False, True])), 11: ("keep_rows", np.array([1, 0, 1, 1], bool)),
              15: ("reset_done", np.array([False, True, False])), 19: ("keep_rows", np.array([0, 1, 1], bool))}
    ref = play(make_agent(model, "stream"), obs, rew, events)
    got = play(GRAPHS[runtime](exported), obs, rew, events)
    assert [a.shape for a in got] == [a.shape for a in ref] and got[-1].shape == (2, 3)
    for a, b in zip(got, ref):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_returned_actions_are_the_callers_to_change(exported):
    """Clipping the returned array in place must not change the a_{t-1} the next step reads."""
    for make in RUNTIMES.values():
        p, q = make(exported), make(exported)
        p.reset(1), q.reset(1)
        obs = np.ones((1, 11))
        a = p.act(obs)
        q.act(obs)
        a[:] = 99.0
        np.testing.assert_array_equal(p.act(obs), q.act(obs))


def test_steps_are_the_graphs_own_run_bit_for_bit(exported):
    """``act`` runs the graph through I/O bindings over two swapping sets of state arrays: its actions
    are those of ``session.run`` with the state threaded by hand, to the bit, through restarts, rows
    leaving (the bindings are remade), a missing reward and an observation that is neither float32
    nor contiguous."""
    policy = OnnxPolicy(exported[1])
    session, meta = policy.session, policy.metadata
    names = [s["name"] for s in meta["state"]]
    dtypes = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "bool": np.bool_}
    g = np.random.default_rng(1)
    B = 4
    state = {n: np.zeros([B, *s["shape"][1:]], dtypes[s["dtype"]]) for n, s in zip(names, meta["state"])}
    reset, target = np.ones(B, bool), np.full(B, 3600.0, np.float32)
    policy.reset(B)
    reward = None
    for t in range(30):
        if t == 9:
            done = np.array([0, 1, 1, 0][:B], bool)
            policy.reset_done(done, target=1800.0)
            reset |= done
            target[done] = 1800.0
        if t in (14, 21):
            keep = np.arange(B) != 1
            policy.keep_rows(keep)
            state = {n: v[keep] for n, v in state.items()}
            reset, target, B = reset[keep], target[keep], B - 1
            reward = reward[keep]
        obs = np.asfortranarray(g.normal(size=(B, 11)))  # float64, column-major
        r = np.zeros(B, np.float32) if reward is None else reward.astype(np.float32)
        feed = {"observation": obs.astype(np.float32), "reward": r, "reset": reset, "target": target,
                **{"state." + n: v for n, v in state.items()}}
        action, *nxt = session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})
        state, reset = dict(zip(names, nxt)), np.zeros(B, bool)
        got = policy.act(obs, reward)
        np.testing.assert_array_equal(got, action, err_msg=f"step {t}")
        reward = None if t == 17 else g.uniform(0, 3, size=B)


def test_threads_and_metadata(exported):
    p = OnnxPolicy(exported[1], threads=2)
    assert p.session.get_session_options().intra_op_num_threads == 2
    assert OnnxPolicy(exported[1]).session.get_session_options().intra_op_num_threads == 1
    assert (p.obs_dim, p.act_dim, p.targets) == (11, 3, (3600.0, 1800.0))
    assert p.metadata["reward_scale"] == 1000.0 and p.metadata["layers"] == ["softmax", "softmax", "primal"]


# -- clear errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("obs, message", [
    (np.zeros(11), r"obs must have shape \[batch, obs_dim=11\] \(one row: obs\[None\]\), got \(11,\)"),
    (np.zeros((2, 17)), r"obs must have shape \[batch, obs_dim=11\], got \(2, 17\)"),
    (np.zeros((3, 11)), r"obs has 3 rows but the policy runs batch=2"),
    (np.zeros((2, 11), dtype=np.int64), "obs must be a floating-point array .* got dtype int64"),
    ([["a"] * 11] * 2, "obs must be a floating-point array .* got dtype <U1"),
])
def test_wrong_observations_are_clear_errors(runtime, obs, message, exported):
    p = RUNTIMES[runtime](exported)
    p.reset(2)
    with pytest.raises(ValueError, match=message):
        p.act(obs)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_misuse_is_a_clear_error(runtime, exported):
    p = RUNTIMES[runtime](exported)
    with pytest.raises(RuntimeError, match=r"call policy.reset\(batch\) before act"):
        p.act(np.zeros((1, 11)))
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
        p.reset(0)
    with pytest.raises(ValueError, match="target must be a finite number or 2 finite numbers"):
        p.reset(2, target=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"target must be a finite number .*float32: at most 3.4e\+38"):
        p.reset(2, target=1e300)  # finite in float64, inf in the float32 every runtime acts in: NaN actions
    p.reset(2)
    with pytest.raises(ValueError, match=r"reward must have shape \[batch=2\], got \(3,\)"):
        p.act(np.zeros((2, 11)), np.zeros(3))
    with pytest.raises(ValueError, match=r"reward must be numbers, one per row, got \['a', 'b'\]"):
        p.act(np.zeros((2, 11)), ["a", "b"])  # numpy's words were "could not convert string to float: 'a'"
    with pytest.raises(ValueError, match=r"done must have shape \[batch=2\]"):
        p.reset_done([True])
    with pytest.raises(ValueError, match="keep_rows would drop every row"):
        p.keep_rows([False, False])
    for rows in ([0, 1], np.array([0.0, 1.0])):  # indices, or numbers: not silently a mask of other rows
        with pytest.raises(ValueError, match="done must be a bool mask"):
            p.reset_done(rows)
    with pytest.raises(FloatingPointError, match=r"not finite in rows \[1\]"):
        p.act(np.array([[0.0] * 11, [np.nan] * 11]))


def test_files_that_are_not_policies_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist .*python -m agents.export"):
        OnnxPolicy(tmp_path / "missing.onnx")
    with pytest.raises(FileNotFoundError, match=f"policy {tmp_path} is a directory, not an exported policy file"):
        OnnxPolicy(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"policy {tmp_path} is a directory, .*format=torchscript"):
        TorchScriptPolicy(tmp_path)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a readable ONNX model"):
        OnnxPolicy(junk)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    plain = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    plain.ir_version = 8
    onnx.save(plain, tmp_path / "plain.onnx")
    with pytest.raises(ValueError, match="without primal-dt policy metadata"):
        OnnxPolicy(tmp_path / "plain.onnx")
    with pytest.raises(ValueError, match="threads must be an integer >= 1 or None"):
        OnnxPolicy(tmp_path / "plain.onnx", threads=0)
    with pytest.raises(ValueError, match="is not a readable TorchScript file"):
        TorchScriptPolicy(junk)


# -- the artefact is checked at load --------------------------------------------------------------------------
def with_metadata(src, dest, change) -> str:
    """A copy of the ONNX file ``src`` at ``dest`` whose policy metadata is ``change(metadata)`` (a dict
    to store as JSON, or a string stored as it is)."""
    model = onnx.load(src)
    entry = next(p for p in model.metadata_props if p.key == onnx_policy.METADATA_KEY)
    meta = change(json.loads(entry.value))
    entry.value = meta if isinstance(meta, str) else json.dumps(meta)
    onnx.save(model, dest)
    return str(dest)


def edit(**fields):
    return lambda m: {**m, **fields}


@pytest.mark.parametrize("change, message", [
    (edit(reward_scale=0), r"field reward_scale must be a finite number > 0, got 0"),
    (edit(targets="abc"), r'field targets must be a non-empty list of finite numbers, got "abc"'),
    (edit(targets=[]), r"field targets must be a non-empty list"),
    (edit(targets=[1e300]), r"field targets must be a non-empty list of finite numbers, got \[1e\+300\]"),
    (edit(obs_dim=17), r"graph input observation is tensor\(float\) \['batch', 11\], but the metadata says "
                       r"tensor\(float\) \[batch, 17\]"),
    (edit(act_dim=2), r"graph output action is .* the metadata says tensor\(float\) \[batch, 2\]"),
    (edit(act_dim="3"), r'field act_dim must be an integer >= 1, got "3"'),
    (edit(obs_dim=True), r"field obs_dim must be an integer >= 1, got true"),
    (lambda m: {**m, "state": m["state"][:-1]}, r"the graph's inputs do not match its metadata \(unexpected: state\."),
    (lambda m: {**m, "state": [{**m["state"][0], "shape": ["batch", 7]}] + m["state"][1:]},
     r"graph input state\.t is tensor\(int64\) \['batch'\], but the metadata says tensor\(int64\) \[batch, 7\]"),
    (lambda m: {**m, "state": [{**m["state"][0], "dtype": "float32"}] + m["state"][1:]},
     r"graph input state\.t is tensor\(int64\)"),
    (lambda m: {**m, "state": [{**m["state"][0], "dtype": "complex"}] + m["state"][1:]},
     r"field state\[0\]\.dtype must be one of"),
    (lambda m: {k: v for k, v in m.items() if k != "state"}, r"field state must be a list"),
    (lambda m: {k: v for k, v in m.items() if k != "obs_dim"}, r"field obs_dim must be an integer >= 1, got null"),
    (edit(schema=99), r"exported by a newer primal-dt"),
    (edit(format="other"), r"is not a primal-dt stream policy"),
    (lambda m: "{not json", r"policy metadata \(primal_dt\.policy\) is not valid JSON"),
    (lambda m: "null", r"policy metadata must be a JSON object, got null"),
    (lambda m: "[1, 2]", r"policy metadata must be a JSON object"),
])
def test_metadata_that_does_not_describe_the_graph_is_refused_at_load(exported, tmp_path, change, message):
    path = with_metadata(exported[1], tmp_path / "crafted.onnx", change)
    with pytest.raises(ValueError, match=message) as err:
        OnnxPolicy(path)
    assert str(err.value).startswith(path)


def test_a_foreign_graph_with_copied_metadata_is_refused(exported, tiny_dt, dt_checkpoint_file, tmp_path):
    """Another policy's graph (a pure primal stack: other state tensors) under this one's metadata."""
    other = export_policy(dt_checkpoint_file(tmp_path, tiny_dt("primalformer-dt", K=4)), "onnx", tmp_path / "o.onnx")
    meta = onnx.load(exported[1]).metadata_props
    path = with_metadata(other, tmp_path / "foreign.onnx",
                         lambda _: next(p.value for p in meta if p.key == onnx_policy.METADATA_KEY))
    with pytest.raises(ValueError, match=r"foreign\.onnx: the graph's inputs do not match its metadata"):
        OnnxPolicy(path)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=True)
                    | st.text(max_size=4), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                                                 max_size=3), max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.dictionaries(st.sampled_from(["format", "schema", "obs_dim", "act_dim", "targets", "reward_scale",
                                              "state", "K"]), JSON, min_size=1, max_size=3),
       drop=st.sets(st.sampled_from(["obs_dim", "act_dim", "targets", "reward_scale", "state"]), max_size=2))
def test_any_metadata_loads_a_working_policy_or_is_one_named_error(exported, edits, drop):
    """Whatever the metadata holds, the policy's checks accept a document it runs with, or raise one
    ValueError naming the file."""
    policy = OnnxPolicy(exported[1])
    meta = {k: v for k, v in {**policy.metadata, **edits}.items() if k not in drop}
    text = json.dumps(meta)
    try:
        checked = onnx_policy.parse_metadata(text, "crafted.onnx")
        p = onnx_policy.GraphPolicy(checked, "crafted.onnx")
        onnx_policy.check_graph(policy.session, checked, "crafted.onnx")
    except ValueError as err:
        assert str(err).startswith("crafted.onnx")
        return
    assert p.obs_dim == 11 and p.act_dim == 3 and all(np.isfinite(p.targets))
    assert checked["reward_scale"] > 0
    policy.reset(2, target=p.targets[0])
    assert np.isfinite(policy.act(np.zeros((2, 11)))).all()
