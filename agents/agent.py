"""Decision-Transformer agents for B episodes at once: ``load_agent("runs/.../last.pt")``, then the loop of
every runtime (``agents.onnx_policy``'s docstring). ``Agent`` runs one step function on explicit state:
``DTStep`` (engine ``stream``) or ``RecomputeStep`` (engine ``recompute``); or the step exported (``onnx_agent``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from primal_dt.attention.base import StateSpec, restart_rows, select_rows
from primal_dt.run import checkpoint as ck_io
from primal_dt.run.runtime import pick_device
from agents.train_config import ENGINES

from . import dt_checkpoint, threads
from .decision_transformer import Batch, DTStep, StepState
from .token_layouts import TOKENS
from .onnx_policy import SCHEMA, OnnxPolicy, Policy, StreamNotTrainedWarning

RUNTIMES = ("auto", "torch", "onnx")


class RecomputeStep(DTStep):
    """The recompute engine, the papers' protocol: ``DTStep`` (the same bookkeeping) whose state is the last
    ``context`` steps (default: the model's K) per row, on which the model runs at every step; rows of
    different lengths are batched with the padding mask. A causal model only."""

    def __init__(self, model, state_mean, state_std, reward_scale: float, *, context: int | None = None):
        stack = model.stack
        bad = [f"layer {i} ({spec.attention})" for i, (spec, b) in enumerate(zip(stack.specs, stack.blocks))
               if not b.attn.causal]
        if not stack.causal or bad:
            raise ValueError(f"engine='recompute' needs a causal model (an action must not see the future); "
                             f"{', '.join(bad) or 'the stack'} is bidirectional. Train with causal mechanisms")
        self.K = int(context or model.cfg.K)  # (a plain attribute: set before Module.__init__ is fine)
        if self.K < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        super().__init__(model, state_mean, state_std, reward_scale)

    def layer_specs(self) -> list[StateSpec]:
        """The last K steps' values of every token kind of the layout (``history.<Batch field>``), their
        timesteps and how many of the K are real."""
        cfg, K = self.model.cfg, self.K
        dtype = next(self.model.parameters()).dtype
        kinds = [TOKENS[k] for k in self.model.tokens.kinds]
        return [*(StateSpec(f"history.{k.field}", (K, k.size(cfg)), dtype) for k in kinds),
                StateSpec("history.timesteps", (K,), torch.int64), StateSpec("history.length", (), torch.int64)]

    def advance(self, t, values, history):
        *tokens, times, length = history
        kinds = [TOKENS[k] for k in self.model.tokens.kinds]
        rows = torch.arange(times.shape[0], device=times.device)
        # the previous step's values known only now (a_{t-1}: 0 at t = 0, then overwritten below) at its position
        tokens = [h.index_put((rows, (length - 1).clamp(min=0)), values[k.source]) if k.lag else h
                  for h, k in zip(tokens, kinds)]
        full = length == self.K

        def shifted(x):  # full rows drop their oldest step
            return torch.where(full.view(-1, *[1] * (x.dim() - 1)), x.roll(-1, 1), x)

        *tokens, times = map(shifted, (*tokens, times))
        pos = length.clamp(max=self.K - 1)
        for h, k in zip(tokens, kinds):  # this step's values; a_t (and what follows it) is not known yet
            h[rows, pos] = 0 if k.lag else values[k.source].to(h.dtype)
        times[rows, pos] = t
        length = (length + 1).clamp(max=self.K)
        L = int(length.max())
        mask = None if bool((length == L).all()) else torch.arange(L, device=times.device) < length.unsqueeze(1)
        fields = {"states": None, "actions": None, "rtg": None} | {k.field: h[:, :L] for h, k in zip(tokens, kinds)}
        pred, _ = self.model(Batch(**fields, timesteps=times[:, :L], mask=mask))
        return pred[rows, length - 1], (*tokens, times, length)


class Agent(Policy):
    """``model`` acting for B rows with the bookkeeping of its run's ``DataInfo`` ``info``."""

    runtime = "torch"

    def __init__(self, model, info, *, engine: str = "stream", target: float | Sequence[float] | None = None,
                 context: int | None = None):
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        if context is not None and engine != "recompute":
            raise ValueError("context applies to engine='recompute' only")
        model.eval()
        stats = (info.state_mean, info.state_std, info.reward_scale)  # (inplace: the agent drops a passed state)
        self.step_fn = DTStep(model, *stats, inplace=True) if engine == "stream" \
            else RecomputeStep(model, *stats, context=context)
        self.model, self.info = model, info
        self.obs_dim, self.act_dim = model.cfg.state_dim, model.cfg.act_dim
        self.device = self.step_fn.mean.device
        if self.device.type == "cpu":  # steps reallocate the same large buffers: keep them mapped (page faults)
            threads.keep_freed_memory()
        self.mean, self.std, self.reward_scale = self.step_fn.mean, self.step_fn.std, self.step_fn.reward_scale
        self.default_target = info.eval_targets[0] if target is None else target

    # -- the rows' state: a row that ends goes back to zero then (restart_rows), so a step restarts none ---
    def _start(self, B, targets):
        self.state = self.step_fn.init(B)
        self.target = torch.as_tensor(targets, dtype=torch.float32, device=self.device)

    def _restart(self, rows, targets):
        rows = torch.as_tensor(rows, device=self.device)
        self.state = StepState.of(restart_rows(self.step_fn.specs, self.state.flat(), rows))
        self.target[rows] = torch.as_tensor(targets, dtype=torch.float32, device=self.device)

    def _keep(self, rows):
        keep = torch.as_tensor(rows, device=self.device)
        self.state = StepState.of(select_rows(self.state.flat(), keep))
        self.target = self.target[keep]

    @torch.inference_mode()
    def _step(self, obs, reward):
        o = torch.from_numpy(np.ascontiguousarray(obs, dtype=np.float32)).to(self.device)
        r = torch.zeros(self.batch, device=self.device) if reward is None else torch.from_numpy(reward).to(self.device)
        action, *state = self.step_fn(o, r, None, self.target, *self.state.flat())
        # prev_action is the returned action's own tensor: keep a copy, the caller may write into it
        self.state = StepState.of(state)._replace(prev_action=action.clone())
        return action.float().cpu().numpy()


def load_agent(checkpoint, engine: str = "stream", *, target: float | Sequence[float] | None = None,
               device: str | torch.device = "cpu", context: int | None = None, data=None,
               runtime: str = "auto") -> Agent | OnnxPolicy:
    """An agent for a DT checkpoint written by ``primal_dt.train``: a file, its run directory, a checkpoint
    dict or a ``DTCheckpoint`` (files are read without running code). ``target`` defaults to the
    checkpoint's first evaluation target; ``agent.info`` is its ``DataInfo``.

    ``runtime``: ``"torch"``, the ``Agent``; ``"onnx"`` (stream engine, CPU), the same step exported once
    per checkpoint file and run by ``OnnxPolicy`` (``cached_export``), the fastest exact runtime on a
    CPU, with the acting API only; ``"auto"`` (default): onnx where it is installed and the request allows
    it, else torch, saying which.

    ``data``: also make sure the checkpoint belongs to a dataset: ``True`` (read where its run read it), a
    source (as ``data_source``) or an ``envs.Trajectories``.
    """
    if engine not in ENGINES:  # before the checkpoint is read and runtime= is judged by it (Agent checks it too late)
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    device = pick_device(device)  # a bad name, absent CUDA or a missing index: one clear ValueError, before loading
    exact_onnx = (engine, device.type) == ("stream", "cpu")
    if runtime == "onnx" and not exact_onnx:
        raise ValueError(f"runtime='onnx' runs the exact stream step on the CPU: it needs engine='stream' and "
                         f"device='cpu' (got {engine!r}, {str(device)!r})")
    ck = dt_checkpoint.load(checkpoint)
    if data is True or isinstance(data, str):
        dt_checkpoint.training_data(ck, None if data is True else data)
    elif data is not None and data is not False:
        dt_checkpoint.check_data(ck.data, data, ck.origin)
    agent = Agent(ck.build_model(device), ck.data, engine=engine, target=target, context=context)
    fidelity = ck.fidelity(engine)
    agent.fidelity = fidelity.record()
    if note := fidelity.note(ck.origin):
        warnings.warn(note.removeprefix("note: "), StreamNotTrainedWarning, stacklevel=2)
    if runtime == "auto":
        from .export import missing_package  # not at the top: ``python -m agents.export`` would import itself twice

        # a checkpoint in memory has no file to key a cached export by: every load would export again
        runtime = "onnx" if exact_onnx and not isinstance(checkpoint, (dict, dt_checkpoint.DTCheckpoint)) \
            and missing_package() is None else "torch"
        what = "the exported stream step on onnxruntime" if runtime == "onnx" else "the PyTorch model"
        print(f"load_agent: runtime={runtime} ({what}; pass runtime='torch' or 'onnx' to choose)", file=sys.stderr)
    if runtime == "onnx":
        return onnx_agent(checkpoint, ck, agent)
    return agent


EXACT = 1e-5
"""largest action difference the ONNX step may show against the torch stream step"""


def onnx_agent(checkpoint, ck, agent):
    """``runtime="onnx"``: an ``OnnxPolicy`` on the export of ``checkpoint`` (a file or run directory, else
    ``ck``), the torch ``agent``'s own step, handed out once a few steps agree with it (``checked``)."""
    from .export import FORMATS, export_policy, missing_package

    if missing_package():
        raise ValueError(f"runtime='onnx' needs the {missing_package()} package: pip install 'primal-dt[export]' "
                         "(or use runtime='torch')")
    source = dt_checkpoint.resolve(checkpoint) if isinstance(checkpoint, (str, Path)) else ck
    path = cached_export(source) if isinstance(source, Path) else None
    with warnings.catch_warnings():  # load_agent has said it of the checkpoint: the graph says it again
        warnings.simplefilter("ignore", StreamNotTrainedWarning)
        if path is not None:
            policy = OnnxPolicy(path)
        else:  # no cache (a checkpoint in memory, or no usable cache directory): a temporary file, gone once read
            with tempfile.TemporaryDirectory(prefix="primal-dt-policy-", ignore_cleanup_errors=True) as tmp:
                policy = OnnxPolicy(export_policy(source, "onnx", Path(tmp) / FORMATS["onnx"], overwrite=True))
    policy = checked(policy, agent)
    policy.default_target, policy.info = agent.default_target, agent.info
    return policy


def cached_export(path: Path) -> Path | None:
    """The ONNX export of the checkpoint file ``path``, from the cache when its graph still has the digest
    recorded beside it, else exported into the cache now; None without a usable cache directory.

    The cache is the user's own, never the run directory: a ``policy.onnx`` there names its checkpoint only
    in its own metadata, which anyone who can write there can copy into a graph that computes something else
    (and a few checked steps cannot tell a graph that deviates later). An entry is named by the checkpoint
    file's SHA-256 and what made the graph: the package's version and the digest of its source (a graph cached
    by other code, an older exporter's, is never what acts), the policy schema and torch's version."""
    from .export import FORMATS, export_policy, package_version, source_digest

    # $XDG_CACHE_HOME/primal-dt/onnx, readable by the user only: nothing is cached where it cannot be made so
    d = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "primal-dt" / "onnx"
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(d)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        return None
    # an upgrade, or any change to the package's code, exports again
    made_by = f"primal-dt{package_version()}-{source_digest()[:16]}-schema{SCHEMA}-torch{torch.__version__}"
    made_by = ''.join(c if c.isalnum() or c in '.-' else '_' for c in made_by)
    entry = lambda sha: (d / f"{sha}-{made_by}.onnx", d / f"{sha}-{made_by}.onnx.sha256")  # noqa: E731
    graph, digest = entry(ck_io.sha256_file(path))
    with contextlib.suppress(OSError):  # (no digest: an export killed before it was written; export again)
        if graph.is_file() and digest.read_text().strip() == ck_io.sha256_file(graph):
            return graph
    try:
        with tempfile.TemporaryDirectory(prefix=".export-", dir=d, ignore_cleanup_errors=True) as tmp:
            # exported from a private copy and filed under the copy's hash: a checkpoint replaced between the hash
            # and the export (by whoever can write its directory) is never filed under the replaced one's hash
            own = Path(shutil.copyfile(path, Path(tmp) / path.name))
            graph, digest = entry(ck_io.sha256_file(own))
            fresh = export_policy(own, "onnx", Path(tmp) / FORMATS["onnx"], overwrite=True)
            ck_io.write_atomic(digest, ck_io.sha256_file(fresh) + "\n", "digest of a cached ONNX export")
            os.replace(fresh, graph)
    except OSError:
        return None  # a full or read-only cache: export without keeping it
    return graph


def checked(policy, torch_agent, steps: int = 12, batch: int = 2, seed: int = 0):
    """``policy`` once ``steps`` steps of ``batch`` rows (a restart of row 0 halfway) beside ``torch_agent``
    agreed to ``EXACT``; a ValueError otherwise."""
    g = np.random.default_rng(seed)
    mean, std = np.asarray(torch_agent.mean.cpu()), np.asarray(torch_agent.std.cpu())
    worst, reward = 0.0, None
    target = float(np.ravel(torch_agent.default_target)[0])
    for p in (policy, torch_agent):
        p.reset(batch, target=target)
    for t in range(steps):
        obs = (mean + std * g.normal(size=(batch, mean.size))).astype(np.float32)
        a, b = policy.act(obs, reward), torch_agent.act(obs, reward)
        worst = max(worst, float(np.abs(a - b).max()))
        reward = g.uniform(0, 3, batch).astype(np.float32)
        if t == steps // 2:
            for p in (policy, torch_agent):
                p.reset_done(np.arange(batch) == 0, target=target)
    if not worst <= EXACT:
        raise ValueError(f"the exported ONNX step disagrees with the torch stream step (largest action difference "
                         f"{worst:.2e} > {EXACT:g}); use runtime='torch'")
    return policy
