"""A Decision-Transformer agent for B episodes at once: the object a simulator loop talks to.

    agent = load_agent("runs/.../last.pt", engine="stream")     # or engine="recompute"
    agent.reset(batch=8)                                         # targets: the checkpoint's first
    obs, _ = venv.reset(seed=...)
    reward = None
    while ...:
        action = agent.act(obs, reward)                          # [B, act_dim] numpy, in [-1, 1]
        obs, reward, term, trunc, _ = venv.step(action)
        agent.reset_done(term | trunc)                           # restart finished rows only

The agent owns the bookkeeping the model was trained with:
- states are normalised with the dataset's mean / std;
- return-to-go R_t = (target - sum of rewards received so far in the episode) / reward_scale;
  ``act(obs, reward)`` takes the reward of the *previous* step (ignored for rows at t = 0, so the
  reward that ended an episode never leaks into the next one);
- timesteps count from 0 per row (clipped to the model's max_timestep - 1 inside the model).

Engines (same checkpoint): ``stream`` (agents.stream: recurrent per-layer states, constant cost per
step) and ``recompute`` (agents.recompute: the model on the last K steps, the papers' protocol).
``precision="bf16"`` (stream only) runs the stack's weight matmuls in bfloat16: faster at large
batches on CPUs with AVX512-BF16 or AMX, but not exact (the README's Precision paragraph).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from primal_dt.attention.precision import check_precision, native_bf16
from primal_dt.run.runtime import pick_device
from agents.train_config import ENGINES

from . import dt_checkpoint, threads
from .decision_transformer import DTStep
from .onnx_policy import OnnxPolicy, Policy
from .recompute import RecomputeEngine, check_recomputable
from .stream import StreamEngine

RUNTIMES = ("torch", "onnx")
"""``load_agent``'s runtimes for the stream engine: the torch ``Agent``, or its export on onnxruntime"""


class StreamNotTrainedWarning(UserWarning):
    """``load_agent(engine="stream")`` of a checkpoint whose stream is not the policy it was trained as."""


class Agent(Policy):
    """``model`` acting for B rows with the bookkeeping it was trained with (the shared acting API,
    its checks and targets: ``agents.onnx_policy.Policy``).

    ``state_mean`` / ``state_std`` / ``reward_scale`` (returns-to-go are divided by it) and the
    default ``target`` (raw return, one or one per row) are required: they belong to the dataset
    and the run, so they come from the checkpoint (``load_agent``) or the caller, never from a
    default here that would silently fit one environment only.
    """

    def __init__(self, model, *, state_mean, state_std, reward_scale: float, target: float | Sequence[float],
                 engine: str = "stream", context: int | None = None, precision: str = "fp32"):
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        if context is not None and engine != "recompute":
            raise ValueError("context applies to engine='recompute' only")
        check_precision(precision)
        if precision != "fp32" and engine != "stream":
            raise ValueError(f"precision={precision!r} applies to engine='stream' only; recompute runs in the model's "
                             "dtype (precision='fp32')")
        if engine == "stream":
            #: the one step function the stream engine runs (built here: its checks fail at construction)
            self.step_fn = DTStep(model.eval(), state_mean, state_std, reward_scale, precision=precision)
            if precision == "bf16" and not native_bf16(next(model.parameters()).device):
                warnings.warn("precision='bf16': this CPU has no native bfloat16 matmuls (AVX512-BF16 or AMX), so "
                              "they are emulated and likely slower than fp32; use precision='fp32'", stacklevel=2)
        else:
            check_recomputable(model, context)
        self.model = model.eval()
        self.engine_name = engine
        self.context = context
        #: matmul precision of the stream step (primal_dt/attention/precision.py): fp32 exact, bf16 faster
        self.precision = precision
        cfg = model.cfg
        self.obs_dim = self.state_dim = cfg.state_dim
        self.act_dim = cfg.act_dim
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.device.type == "cpu":  # steps reallocate the same large buffers: keep them mapped (page faults)
            threads.keep_freed_memory()
        mean = torch.as_tensor(np.asarray(state_mean, dtype=np.float32), device=self.device)
        std = torch.as_tensor(np.asarray(state_std, dtype=np.float32), device=self.device)
        if mean.shape != (self.state_dim,) or std.shape != (self.state_dim,):
            raise ValueError(f"state_mean / state_std must have shape [{self.state_dim}], got "
                             f"{tuple(mean.shape)} / {tuple(std.shape)}")
        self.mean, self.std = mean, std
        if not reward_scale > 0:
            raise ValueError(f"reward_scale must be > 0, got {reward_scale}")
        self.reward_scale = float(reward_scale)
        self.default_target = target
        self.engine = None

    @classmethod
    def for_data(cls, model, info, *, engine: str = "stream", target=None, context: int | None = None,
                 precision: str = "fp32") -> "Agent":
        """The agent of a trained ``model`` with its run's bookkeeping, ``info`` (the checkpoint's
        ``DataInfo``: normalisation statistics, reward scale, targets): the one place an agent is built
        from a run, so ``load_agent``, the evaluators, videos and benchmarks repeat the same bookkeeping.
        ``target`` defaults to the run's first."""
        agent = cls(model, state_mean=info.state_mean, state_std=info.state_std, reward_scale=info.reward_scale,
                    target=info.eval_targets[0] if target is None else target, engine=engine, context=context,
                    precision=precision)
        agent.info = info
        return agent

    # -- the rows' state (the shared API is Policy's; each engine keeps its rows' bookkeeping) ----------
    def _start(self, B, targets):
        targets = torch.as_tensor(targets, dtype=torch.float32, device=self.device)
        if self.engine_name == "stream":
            self.engine = StreamEngine(self.step_fn, B, targets)
        else:
            self.engine = RecomputeEngine(self.model, B, targets, mean=self.mean, std=self.std,
                                          reward_scale=self.reward_scale, context=self.context)

    def _restart(self, rows, targets):
        self.engine.reset_rows(torch.as_tensor(rows, device=self.device),
                               torch.as_tensor(targets, dtype=torch.float32, device=self.device))

    def _keep(self, rows):
        self.engine.keep_rows(torch.as_tensor(rows, device=self.device))

    def _step(self, obs, reward):
        o = torch.from_numpy(np.ascontiguousarray(obs, dtype=np.float32)).to(self.device)
        r = None if reward is None else torch.from_numpy(reward).to(self.device)
        return self.engine.act(o, r).float().cpu().numpy()

    @property
    def timesteps(self) -> np.ndarray:
        return self.engine.timesteps.cpu().numpy().copy()

    @property
    def returns_to_go(self) -> np.ndarray:
        """Current R_t per row, unscaled (raw return units)."""
        return (self.engine.returns_to_go.double() * self.reward_scale).cpu().numpy()


def load_agent(checkpoint, engine: str = "stream", *, target: float | Sequence[float] | None = None,
               device: str | torch.device = "cpu", context: int | None = None, data=None,
               precision: str = "fp32", runtime: str = "torch") -> Agent | OnnxPolicy:
    """An agent for a DT checkpoint written by ``primal_dt.train``: a file, its run directory (its
    last.pt), a checkpoint dict or an ``agents.dt_checkpoint.DTCheckpoint``. Files are read without
    running code (``weights_only=True``).

    ``target`` defaults to the checkpoint's first evaluation target (or, for a checkpoint that
    recorded none, its environment's first: ``envs.get_spec(env).targets``). ``agent.info`` is the
    checkpoint's ``DataInfo`` (env, simulator, statistics, targets, data source and fingerprint).

    ``runtime="onnx"`` (stream engine, fp32, CPU): the same stream step exported to ONNX and run by
    ``agents.onnx_policy.OnnxPolicy``, the fastest exact runtime on a CPU (several times faster at batch 1;
    agents/onnx_agent.py: cached in the user's cache directory, checked against the torch agent to 1e-5 before it
    is returned). It has the acting API (``reset``, ``act``, ``reset_done``, ``keep_rows``, ``info``), not
    the torch agent's model, engines and precisions; ``"torch"`` (default) is the ``Agent``.

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
    if runtime == "onnx" and (engine, precision, device.type) != ("stream", "fp32", "cpu"):
        raise ValueError(f"runtime='onnx' runs the exact stream step on the CPU: it needs engine='stream', "
                         f"precision='fp32' and device='cpu' (got {engine!r}, {precision!r}, {str(device)!r})")
    ck = dt_checkpoint.load(checkpoint)
    if data is True or isinstance(data, str):
        dt_checkpoint.training_data(ck, None if data is True else data)
    elif data is not None and data is not False:
        dt_checkpoint.check_data(ck.data, data, ck.origin)
    agent = Agent.for_data(ck.build_model(device), ck.data, engine=engine, target=target, context=context,
                           precision=precision)
    agent.fidelity = ck.fidelity(engine).record()
    note = ck.fidelity(engine).note(ck.origin)
    if note:
        warnings.warn(note.removeprefix("note: "), StreamNotTrainedWarning, stacklevel=2)
    if runtime == "onnx":
        from .onnx_agent import onnx_agent

        return onnx_agent(checkpoint, ck, agent)
    return agent

