"""A Decision-Transformer agent for B episodes at once: the object a simulator loop talks to.

    agent = load_agent("runs/.../last.pt")                       # engine="stream" (default) or "recompute"
    agent.reset(batch=8)                                         # targets: the checkpoint's first
    obs, _ = venv.reset(seed=...)
    reward = None
    while ...:
        action = agent.act(obs, reward)                          # [B, act_dim] numpy, in [-1, 1]
        obs, reward, term, trunc, _ = venv.step(action)
        agent.reset_done(term | trunc)                           # restart finished rows only

``Agent(model, info)`` is the one way an agent is built from a model and its run's ``DataInfo``
(``load_agent`` reads both from a checkpoint; the evaluators, videos and benchmarks call it with a model
in memory). It runs one step function on explicit state: ``DTStep`` (engine ``stream``, whose module
documents the bookkeeping and what a streamed token sees) or ``RecomputeStep`` (engine ``recompute``: the
same bookkeeping with the last K steps as its state, the papers' protocol). ``precision="bf16"`` (stream
only) runs the stack's weight matmuls in bfloat16: faster at large batches on CPUs with AVX512-BF16 or
AMX, but not exact.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from typing import Sequence

import numpy as np
import torch

from primal_dt.attention.base import restart_rows, select_rows
from primal_dt.attention.precision import check_precision, native_bf16
from primal_dt.run.runtime import pick_device
from agents.train_config import ENGINES

from . import dt_checkpoint, threads
from .decision_transformer import DTStep, StepState
from .onnx_policy import OnnxPolicy, Policy
from .recompute import RecomputeStep

RUNTIMES = ("auto", "torch", "onnx")
"""``load_agent``'s runtimes: ``torch`` (the ``Agent``), ``onnx`` (its stream step exported, on onnxruntime),
``auto`` (onnx where it is installed and exact for the request, else torch)"""


class StreamNotTrainedWarning(UserWarning):
    """``load_agent(engine="stream")`` of a checkpoint whose stream is not the policy it was trained as."""


class Agent(Policy):
    """``model`` (a ``DecisionTransformer``) acting for B rows with the bookkeeping of its run, ``info``
    (the checkpoint's ``DataInfo``: normalisation statistics, reward scale, targets); ``target`` defaults to
    the run's first (the shared acting API, its checks and targets: ``agents.onnx_policy.Policy``)."""

    runtime = "torch"

    def __init__(self, model, info, *, engine: str = "stream", target: float | Sequence[float] | None = None,
                 context: int | None = None, precision: str = "fp32"):
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        if context is not None and engine != "recompute":
            raise ValueError("context applies to engine='recompute' only")
        check_precision(precision)
        if precision != "fp32" and engine != "stream":
            raise ValueError(f"precision={precision!r} applies to engine='stream' only; recompute runs in the model's "
                             "dtype (precision='fp32')")
        model.eval()
        stats = (info.state_mean, info.state_std, info.reward_scale)
        if engine == "stream":
            #: the one step function the agent runs (built here: its checks fail at construction)
            self.step_fn = DTStep(model, *stats, precision=precision, inplace=True)  # (the agent drops a passed state)
            if precision == "bf16" and not native_bf16(next(model.parameters()).device):
                warnings.warn("precision='bf16': this CPU has no native bfloat16 matmuls (AVX512-BF16 or AMX), so "
                              "they are emulated and likely slower than fp32; use precision='fp32'", stacklevel=2)
        else:
            self.step_fn = RecomputeStep(model, *stats, context=context)
        self.model, self.info = model, info
        self.engine, self.context, self.precision = engine, context, precision
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

    @property
    def timesteps(self) -> np.ndarray:
        """t per row: steps taken in the row's episode."""
        return self.state.t.cpu().numpy()

    @property
    def returns_to_go(self) -> np.ndarray:
        """Current R_t per row, unscaled (raw return units): the target at a row's first step."""
        rtg = torch.where(self.state.t == 0, self.target / self.reward_scale, self.state.rtg)
        return (rtg.double() * self.reward_scale).cpu().numpy()


def onnx_runtime_installed() -> bool:
    """Whether onnxruntime and the exporter (onnx, onnxscript: the ``export`` extra) are importable."""
    return all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime", "onnxscript"))


def load_agent(checkpoint, engine: str = "stream", *, target: float | Sequence[float] | None = None,
               device: str | torch.device = "cpu", context: int | None = None, data=None,
               precision: str = "fp32", runtime: str = "auto") -> Agent | OnnxPolicy:
    """An agent for a DT checkpoint written by ``primal_dt.train``: a file, its run directory (its
    last.pt), a checkpoint dict or an ``agents.dt_checkpoint.DTCheckpoint``. Files are read without
    running code (``weights_only=True``).

    ``target`` defaults to the checkpoint's first evaluation target (or, for a checkpoint that
    recorded none, its environment's first: ``envs.get_spec(env).targets``). ``agent.info`` is the
    checkpoint's ``DataInfo`` (env, simulator, statistics, targets, data source and fingerprint).

    ``runtime``: ``"torch"``, the ``Agent``; ``"onnx"`` (stream engine, fp32, CPU), the same stream step
    exported to ONNX and run by ``agents.onnx_policy.OnnxPolicy``, the fastest exact runtime on a CPU
    (``agents.onnx_agent``: the export is cached per checkpoint file and checked against the torch agent to
    1e-5 before it is returned). It has the acting API (``reset``, ``act``, ``reset_done``, ``keep_rows``,
    ``info``), not the torch agent's model and engines. ``"auto"`` (default) takes onnx when it is installed
    and the request allows it (a checkpoint file, stream, fp32, CPU), else torch, and prints which (the
    result's ``runtime`` says it too). A checkpoint's first onnx load exports it (tens of seconds, once);
    where that is more than a short use gains, ask for ``"torch"``.

    ``data``: also make sure the checkpoint belongs to a dataset: ``True`` (read it where its run
    read it), a source to read it from (``"auto"``, ``"d4rl:PATH"``, ... as ``primal_dt.train``'s
    ``data_source``) or an ``envs.Trajectories``. Data whose content differs from what the
    checkpoint was trained on is a ValueError naming both sources (``agents.dt_checkpoint.check_data``).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    device = pick_device(device)  # a bad name, absent CUDA or a missing index: one clear ValueError, before loading
    exact_onnx = (engine, precision, device.type) == ("stream", "fp32", "cpu")
    if runtime == "onnx" and not exact_onnx:
        raise ValueError(f"runtime='onnx' runs the exact stream step on the CPU: it needs engine='stream', "
                         f"precision='fp32' and device='cpu' (got {engine!r}, {precision!r}, {str(device)!r})")
    ck = dt_checkpoint.load(checkpoint)
    if data is True or isinstance(data, str):
        dt_checkpoint.training_data(ck, None if data is True else data)
    elif data is not None and data is not False:
        dt_checkpoint.check_data(ck.data, data, ck.origin)
    agent = Agent(ck.build_model(device), ck.data, engine=engine, target=target, context=context, precision=precision)
    agent.fidelity = ck.fidelity(engine).record()
    note = ck.fidelity(engine).note(ck.origin)
    if note:
        warnings.warn(note.removeprefix("note: "), StreamNotTrainedWarning, stacklevel=2)
    if runtime == "auto":
        # a checkpoint in memory has no file to key a cached export by: every load would export again
        runtime = "onnx" if exact_onnx and not isinstance(checkpoint, (dict, dt_checkpoint.DTCheckpoint)) \
            and onnx_runtime_installed() else "torch"
        print(f"load_agent: runtime={runtime} ({'the exported stream step on onnxruntime' if runtime == 'onnx' else 'torch'}"
              f"; runtime='torch' or 'onnx' to choose)", file=sys.stderr)
    if runtime == "onnx":
        from .onnx_agent import onnx_agent

        return onnx_agent(checkpoint, ck, agent)
    return agent
