"""Run an exported Decision-Transformer policy with numpy and onnxruntime only: no torch, no primal-dt.

This file is meant to be copied next to a ``policy.onnx`` written by ``python -m agents.export`` and
used on its own (it imports nothing but numpy, onnxruntime and the standard library):

    from onnx_policy import OnnxPolicy
    policy = OnnxPolicy("policy.onnx")          # threads=1 unless told otherwise
    policy.reset(batch=8)                       # target: the checkpoint's first, or target=...
    obs, _ = venv.reset(seed=list(range(8)))
    reward = None
    while ...:
        action = policy.act(obs, reward)        # [8, act_dim] float32; reward: the previous step's
        obs, reward, term, trunc, _ = venv.step(action)
        policy.reset_done(term | trunc)         # restart only the finished rows

The graph is the torch agent's step, recurrent state as explicit inputs and outputs; ``Policy``, the
acting API of every runtime, is defined here so that this file stands alone.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np

METADATA_KEY = "primal_dt.policy"
"""ONNX metadata_props key (TorchScript: the extra file ``METADATA_KEY + ".json"``) of the JSON document"""
FORMAT = "primal-dt stream policy"
SCHEMA = 1
INPUTS = ("observation", "reward", "reset", "target")
"""the step's inputs before the state tensors (``state.<name>``); outputs: ``action``, ``next_state.<name>``"""
STATE_IN, STATE_OUT = "state.", "next_state."
_DTYPES = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "bool": np.bool_}
DISABLED_FUSIONS = ["SkipLayerNormFusion"]
"""onnxruntime fusions turned off: its CPU SkipLayerNormalization (a residual Add fused into the LayerNorm
after it) is slower than the two operators at a stream step's few tokens per row (eval/bench/inference.py)"""
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_ROW_VALUES = 2**24
"""values one row of observations, actions or recurrent state may hold: far above any simulator's (MuJoCo's
largest observes a few hundred) and a model's state, far below what a crafted ``obs_dim`` asks a reset to allocate"""
"""a target beyond it is inf once in the float32 the graphs compute in (actions NaN at the first step)"""
_ONNX_TYPES = {"float32": "tensor(float)", "float64": "tensor(double)", "int64": "tensor(int64)", "bool": "tensor(bool)"}


def parse_metadata(text: str | None, where: str) -> dict:
    if text is None:
        raise ValueError(f"{where} is an ONNX model without primal-dt policy metadata; export one with "
                         "python -m agents.export")
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as err:  # this file stands alone (no primal_dt.run.json_reader): nesting too
        raise ValueError(f"{where}: its policy metadata ({METADATA_KEY}) is not valid JSON ({err})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: its policy metadata must be a JSON object, got {text[:60]}")
    return meta


def check_metadata(meta: dict, where: str) -> None:
    """Every field a runtime reads, so a damaged or edited artefact is one ``ValueError`` at load."""
    def bad(field: str, want: str, got) -> ValueError:
        return ValueError(f"{where}: policy metadata field {field} must be {want}, got {json.dumps(got)[:60]}")

    def integer(v, low: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    def finite(v) -> bool:  # in float32, as the runtime passes it to the graph
        return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= FLOAT32_MAX

    if meta.get("format") != FORMAT:
        raise ValueError(f"{where} is not a primal-dt stream policy (its metadata says format "
                         f"{meta.get('format')!r}); export one with python -m agents.export")
    if not integer(meta.get("schema"), 1):
        raise bad("schema", "an integer >= 1", meta.get("schema"))
    if meta["schema"] > SCHEMA:
        raise ValueError(f"{where} was exported by a newer primal-dt (policy schema {meta['schema']}, this "
                         f"runtime reads <= {SCHEMA}); use the onnx_policy.py of that release")
    fields = {
        "obs_dim": (lambda v: integer(v, 1), "an integer >= 1"),
        "act_dim": (lambda v: integer(v, 1), "an integer >= 1"),
        "targets": (lambda v: isinstance(v, list) and v and all(map(finite, v)), "a non-empty list of finite numbers"),
        "reward_scale": (lambda v: finite(v) and v > 0, "a finite number > 0"),
        "stream_exact": (lambda v: isinstance(v, bool),
                         "true or false (whether the stream is the policy the checkpoint was trained as)"),
        "stream_window": (lambda v: integer(v, 0), "an integer >= 0"),
        "stream_from_start": (lambda v: isinstance(v, bool),
                              "true or false (whether the checkpoint trained on episode prefixes)"),
        "stream_whole_episodes": (lambda v: isinstance(v, bool),
                                  "true or false (whether the checkpoint trained on whole episodes in chunks)"),
    }
    for field, (ok, want) in fields.items():
        if not ok(meta.get(field)):
            raise bad(field, want, meta.get(field))
    for field in ("obs_dim", "act_dim"):  # allocated at every reset, per row
        if meta[field] > MAX_ROW_VALUES:
            raise bad(field, f"at most {MAX_ROW_VALUES} (values per row)", meta[field])
    state = meta.get("state")
    if not isinstance(state, list):
        raise bad("state", "a list of state tensors {name, shape, dtype}", state)
    names = set()
    for i, spec in enumerate(state):
        if not isinstance(spec, dict):
            raise bad(f"state[{i}]", "an object {name, shape, dtype}", spec)
        if not isinstance(spec.get("name"), str) or not spec["name"] or spec["name"] in names:
            raise bad(f"state[{i}].name", "a non-empty string naming one state tensor", spec.get("name"))
        names.add(spec["name"])
        shape = spec.get("shape")
        if not (isinstance(shape, list) and shape and all(integer(d, 0) for d in shape[1:])):
            raise bad(f"state[{i}].shape", "a list [batch, sizes >= 0 ...]", shape)
        if math.prod(shape[1:]) > MAX_ROW_VALUES:
            raise bad(f"state[{i}].shape", f"of at most {MAX_ROW_VALUES} values per row", shape)
        if spec.get("dtype") not in _DTYPES:
            raise bad(f"state[{i}].dtype", f"one of {', '.join(_DTYPES)}", spec.get("dtype"))


def check_graph(session, meta: dict, where: str) -> None:
    """The ONNX graph's inputs and outputs against its checked metadata: a graph exported for another
    policy under copied metadata is refused."""
    state = meta["state"]
    want_in = {"observation": ("float32", [meta["obs_dim"]]), "reward": ("float32", []), "reset": ("bool", []),
               "target": ("float32", [])} | {STATE_IN + s["name"]: (s["dtype"], s["shape"][1:]) for s in state}
    want_out = {"action": ("float32", [meta["act_dim"]])} | {
        STATE_OUT + s["name"]: (s["dtype"], s["shape"][1:]) for s in state}
    for kind, args, want in (("input", session.get_inputs(), want_in), ("output", session.get_outputs(), want_out)):
        have = {a.name: a for a in args}
        # an input the graph never reads is pruned by the exporter; every output must be there
        needed = set(want) if kind == "output" else {"observation"}
        extra, missing = sorted(set(have) - set(want)), sorted(needed - set(have))
        if extra or missing:
            raise ValueError(f"{where}: the graph's {kind}s do not match its metadata (unexpected: "
                             f"{', '.join(extra) or 'none'}; missing: {', '.join(missing) or 'none'}); it was "
                             "exported for another policy, or its metadata was edited")
        for name, a in have.items():
            dtype, dims = want[name]
            graph = list(a.shape)
            if a.type != _ONNX_TYPES[dtype] or len(graph) != 1 + len(dims) or any(
                    isinstance(g, int) and g != w for g, w in zip(graph[1:], dims)):
                raise ValueError(f"{where}: graph {kind} {name} is {a.type} {graph}, but the metadata says "
                                 f"{_ONNX_TYPES[dtype]} [batch{''.join(f', {w}' for w in dims)}]")


class Policy:
    """The acting API of every runtime (``agents.Agent``, ``OnnxPolicy``, ``TorchScriptPolicy``): B rows
    (episodes) act at once, each restarted or dropped on its own. It owns every check on what a caller
    passes, so the runtimes agree on them; a runtime sets ``obs_dim``, ``act_dim``, ``default_target`` and
    fills the four hooks below (targets: raw returns, float64)."""

    obs_dim: int
    act_dim: int
    default_target: float | list[float]
    batch: int = 0
    runtime: str = ""
    """which runtime acts: "torch", "onnx" or "torchscript" (what ``load_agent(runtime="auto")`` picked)"""
    fidelity: dict | None = None
    """``agents.stream_training.Fidelity.record()`` of the checkpoint acting (None for a bare model)"""

    def _targets(self, target, n: int) -> np.ndarray:
        arr = np.asarray(self.default_target if target is None else target, dtype=np.float64).reshape(-1)
        if arr.size == 1:
            arr = np.full(n, arr[0])
        if arr.size != n or not (np.abs(arr) <= FLOAT32_MAX).all():  # (NaN fails it too)
            raise ValueError(f"target must be a finite number or {n} finite numbers (one per restarted row; float32: "
                             f"at most {FLOAT32_MAX:.3g} in size), got {target!r}")
        return arr

    def reset(self, batch: int, target=None) -> None:
        """Start ``batch`` new episodes (rows); ``target`` is the return to aim for, one or per row."""
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
        targets = self._targets(target, int(batch))
        self.batch = int(batch)
        self._start(self.batch, targets)

    def reset_done(self, done, target=None) -> None:
        """Restart the rows where ``done`` ([B] bool) is True; ``target``: one, or one per restarted row."""
        d = self._rows(done, "done")
        if d.any():
            self._restart(d, self._targets(target, int(d.sum())))

    def keep_rows(self, keep) -> None:
        """Continue with the rows where ``keep`` ([B] bool) is True only, in their order."""
        k = self._rows(keep, "keep")
        if not k.any():
            raise ValueError("keep_rows would drop every row; call reset(batch) to start over")
        if not k.all():
            self.batch = int(k.sum())
            self._keep(k)

    def _rows(self, flags, what: str) -> np.ndarray:
        self._require_reset()
        f = np.asarray(flags)
        if f.shape != (self.batch,):
            raise ValueError(f"{what} must have shape [batch={self.batch}], got {f.shape}")
        if f.dtype != np.bool_:  # row indices [0, 2] would have read as the mask [False, True]
            raise ValueError(f"{what} must be a bool mask (one True/False per row, e.g. term | trunc), got {f.dtype}")
        return f

    def _require_reset(self) -> None:
        if not self.batch:
            raise RuntimeError("call policy.reset(batch) before act / reset_done / keep_rows")

    def act(self, obs, reward=None) -> np.ndarray:
        """One action per row ([B, act_dim] float32, the caller's to keep) for observations ``obs``
        [B, obs_dim]; ``reward`` [B]: the previous step's (None at the first; ignored at a row's first step)."""
        self._require_reset()
        o = np.asarray(obs)
        if o.dtype.kind != "f":
            raise ValueError(f"obs must be a floating-point array (the simulator's observations), got dtype "
                             f"{o.dtype}")
        if o.ndim != 2 or o.shape[1] != self.obs_dim:
            hint = " (one row: obs[None])" if o.shape == (self.obs_dim,) else ""
            raise ValueError(f"obs must have shape [batch, obs_dim={self.obs_dim}]{hint}, got {o.shape}")
        if o.shape[0] != self.batch:
            raise ValueError(f"obs has {o.shape[0]} rows but the policy runs batch={self.batch} (set by reset(batch) "
                             "and keep_rows)")
        r = None
        if reward is not None:
            try:
                r = np.asarray(reward, dtype=np.float32)
            except (ValueError, TypeError):
                raise ValueError(f"reward must be numbers, one per row, got {reward!r}") from None
            if r.shape != (self.batch,):
                raise ValueError(f"reward must have shape [batch={self.batch}], got {r.shape}")
        action = self._step(o, r)
        flat = action.reshape(-1)
        if not math.isfinite(flat.dot(flat)):  # one BLAS call, no temporary array, on the steps that pass
            rows = np.flatnonzero(~np.isfinite(action).all(1)).tolist()
            raise FloatingPointError(f"the policy's actions are not finite in rows {rows}: check their observations "
                                     "and rewards (NaN or inf?); a cosformer layer also gives NaN once an episode "
                                     "passes its max_len tokens (restart the row with reset_done)")
        return action

    # -- what a runtime fills in
    def _start(self, batch: int, targets: np.ndarray) -> None:
        raise NotImplementedError

    def _restart(self, rows: np.ndarray, targets: np.ndarray) -> None:
        raise NotImplementedError

    def _keep(self, rows: np.ndarray) -> None:
        """Keep only the rows where ``rows`` is True (some, not all; ``batch`` is already their count)."""
        raise NotImplementedError

    def _step(self, obs: np.ndarray, reward: np.ndarray | None) -> np.ndarray:
        """The action [B, act_dim] float32, an array the caller owns, for checked ``obs`` and ``reward``."""
        raise NotImplementedError


class StreamNotTrainedWarning(UserWarning):
    """A stream that is not the policy its checkpoint was trained as (``load_agent``, ``OnnxPolicy``,
    ``TorchScriptPolicy``); defined in this file so that the copied-out runtime warns as the package does."""


def stream_note(what: str) -> str:
    """The line said of an exported graph whose checkpoint trained on K-step segments: what it is, and how to get
    an exact one (its metadata's ``stream_exact`` is false)."""
    return (f"{what} streams a checkpoint trained on K-step segments, so its actions (every layer over the whole "
            "episode so far) are not the policy training optimised, and scores measured with it are not that "
            "policy's. For an exact exported policy, export a checkpoint trained for the stream: python -m "
            "primal_dt.train ... whole_episodes=true (whole episodes in chunks carrying the stream's state), "
            "stream_window=W (every layer windowed, e.g. stream_window=21 K=40, as far back as recompute sees) or "
            "from_start=true K=1000 (episode prefixes)")


class GraphPolicy(Policy):
    """``Policy`` around an exported step graph: the state between calls, the reset flags, each row's
    target. Runtimes fill ``_step``, the graph on (observation, reward, ``_reset``, ``_target_rows``,
    *``_state``)."""

    def __init__(self, metadata: dict, where: str):
        check_metadata(metadata, where)
        self.metadata = metadata
        self.obs_dim, self.act_dim = int(metadata["obs_dim"]), int(metadata["act_dim"])
        self.targets = tuple(float(t) for t in metadata["targets"])
        self.default_target = self.targets[0]
        self.fidelity = {"engine": "stream", "exact": metadata["stream_exact"],
                         "stream_window": metadata["stream_window"], "from_start": metadata["stream_from_start"],
                         "whole_episodes": metadata["stream_whole_episodes"]}
        if not metadata["stream_exact"]:  # stacklevel: the line that built the runtime (OnnxPolicy(...))
            warnings.warn(stream_note(where), StreamNotTrainedWarning, stacklevel=3)
        self.state_layout = [(s["name"], tuple(s["shape"][1:]), _DTYPES[s["dtype"]]) for s in metadata["state"]]
        self.input_names = [*INPUTS, *(STATE_IN + name for name, _, _ in self.state_layout)]
        self.output_names = ["action", *(STATE_OUT + name for name, _, _ in self.state_layout)]
        self._state: list[np.ndarray] = []

    def _start(self, batch, targets):
        self._target_rows = targets.astype(np.float32)
        self._reset = np.ones(batch, dtype=np.bool_)
        self._state = [np.zeros((batch, *shape), dtype=dtype) for _, shape, dtype in self.state_layout]
        self._rows_changed()

    def _restart(self, rows, targets):
        self._reset |= rows
        self._target_rows[rows] = targets

    def _keep(self, rows):
        self._state = [s[rows] for s in self._state]
        self._reset, self._target_rows = self._reset[rows], self._target_rows[rows]
        self._rows_changed()

    def _rows_changed(self) -> None:
        """Hook: ``reset`` or ``keep_rows`` replaced the row arrays (the others write into them in place)."""


class OnnxPolicy(GraphPolicy):
    """An exported ``policy.onnx`` on onnxruntime's CPU provider (module docstring). ``threads``: intra-op
    threads (None: 1, fastest for a stream step's small matrices and never collapsing beside another busy
    process; give more for batches in the hundreds).

    ``act`` runs the graph through I/O bindings made when the rows change, the state in two sets of arrays
    that swap roles each step: at batch 1, ``session.run``'s wrapping and allocating is a large part of a
    step."""

    runtime = "onnx"

    def __init__(self, path, threads: int | None = None):
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            what = "is a directory, not an exported policy file" if path.is_dir() else "does not exist"
            raise FileNotFoundError(f"policy {path} {what} (export one with python -m agents.export "
                                    "checkpoint=RUN format=onnx out=PATH)")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be an integer >= 1 or None, got {threads!r}")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or 1
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"],
                                                disabled_optimizers=DISABLED_FUSIONS)
        except Exception as err:  # onnxruntime raises its own types for unreadable or foreign files
            raise ValueError(f"{path} is not a readable ONNX model: {err}") from err
        super().__init__(parse_metadata(self.session.get_modelmeta().custom_metadata_map.get(METADATA_KEY),
                                        str(path)), str(path))
        check_graph(self.session, self.metadata, str(path))
        self._ort_value = ort.OrtValue.ortvalue_from_numpy
        present = {i.name for i in self.session.get_inputs()}  # an input the graph never reads is not one
        self._feed = [(i, n) for i, n in enumerate(self.input_names) if n in present]

    def _rows_changed(self) -> None:
        """Two bindings (even and odd steps), each kept with the arrays whose addresses it holds."""
        B = self.batch
        self._obs = np.zeros((B, self.obs_dim), dtype=np.float32)
        self._reward = np.zeros(B, dtype=np.float32)
        self._action = np.zeros((B, self.act_dim), dtype=np.float32)
        self._states = (self._state, [np.zeros_like(s) for s in self._state])
        self._bindings, self._parity = [], 0
        for step in (0, 1):
            inputs = [self._obs, self._reward, self._reset, self._target_rows, *self._states[step]]
            outputs = [self._action, *self._states[1 - step]]
            io = self.session.io_binding()
            for i, name in self._feed:
                io.bind_ortvalue_input(name, self._ort_value(inputs[i]))
            for name, array in zip(self.output_names, outputs):
                io.bind_ortvalue_output(name, self._ort_value(array))
            self._bindings.append((io, inputs, outputs))

    def _step(self, obs, reward):
        np.copyto(self._obs, obs)
        np.copyto(self._reward, 0.0 if reward is None else reward)
        self.session.run_with_iobinding(self._bindings[self._parity][0])
        self._reset.fill(False)
        self._parity ^= 1
        self._state = self._states[self._parity]
        return self._action.copy()
