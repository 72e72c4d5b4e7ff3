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
``precision="bf16"`` (stream only) runs the stack's weight matmuls in bfloat16: about 2x faster at
large batches on CPUs with AVX512-BF16 or AMX, actions within a few 1e-3 of fp32's, not exact.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from primal_dt import runtime
from primal_dt.attention.precision import check_precision, native_bf16

from . import dt_checkpoint
from .decision_transformer import DTStep
from .recompute import RecomputeEngine, check_recomputable
from .stream import StreamEngine

ENGINES = ("stream", "recompute")


class Agent:
    """``model`` acting for B rows with the bookkeeping it was trained with.

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
            self.step_fn = DTStep(model.eval(), state_mean, state_std, reward_scale, precision=precision, inplace=True)
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
        self.state_dim, self.act_dim = cfg.state_dim, cfg.act_dim
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.device.type == "cpu":  # steps reallocate the same large buffers: keep them mapped (page faults)
            runtime.keep_freed_memory()
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
        self.batch = 0
        self.engine = None

    # -- episode bookkeeping ------------------------------------------------------------------
    def _targets(self, target, n: int) -> torch.Tensor:
        """Raw returns to aim for, one per row."""
        t = self.default_target if target is None else target
        arr = np.asarray(t, dtype=np.float64).reshape(-1)
        if arr.size == 1:
            arr = np.full(n, arr[0])
        if arr.size != n:
            raise ValueError(f"target must be a number or {n} numbers (one per restarted row), got {arr.size}")
        return torch.as_tensor(arr, dtype=torch.float32, device=self.device)

    def reset(self, batch: int, target: float | Sequence[float] | None = None) -> None:
        """Start ``batch`` new episodes (rows); ``target`` is the return to aim for, one or per row."""
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
        B = self.batch = int(batch)
        targets = self._targets(target, B)
        if self.engine_name == "stream":
            self.engine = StreamEngine(self.step_fn, B, targets)
        else:
            self.engine = RecomputeEngine(self.model, B, self.context)
        self.rtg = targets / self.reward_scale
        self.t = torch.zeros(B, dtype=torch.long, device=self.device)
        self.prev_action = torch.zeros(B, self.act_dim, dtype=self.dtype, device=self.device)
        self.first = torch.ones(B, dtype=torch.bool, device=self.device)
        self._any_first = True

    def reset_done(self, done, target: float | Sequence[float] | None = None) -> None:
        """Restart the rows where ``done`` ([B] bool) is True; other rows keep their state.
        ``target``: the new episodes' return target (one, or one per restarted row)."""
        self._require_reset()
        d = np.asarray(done.cpu() if isinstance(done, torch.Tensor) else done)
        if d.shape != (self.batch,):
            raise ValueError(f"done must have shape [batch={self.batch}], got {d.shape}")
        d = d.astype(bool)
        n = int(d.sum())
        if n == 0:
            return
        rows = torch.as_tensor(d, device=self.device)
        targets = self._targets(target, n)
        self.engine.reset_rows(rows, targets)
        self.rtg[rows] = targets / self.reward_scale
        self.t[rows] = 0
        self.prev_action[rows] = 0
        self.first[rows] = True
        self._any_first = True

    def keep_rows(self, keep) -> None:
        """Continue with the rows where ``keep`` ([B] bool) is True only, in their order; the
        others are dropped (the batch shrinks: an evaluator whose episodes are done stops paying
        for them). At least one row must remain."""
        self._require_reset()
        k = np.asarray(keep.cpu() if isinstance(keep, torch.Tensor) else keep)
        if k.shape != (self.batch,):
            raise ValueError(f"keep must have shape [batch={self.batch}], got {k.shape}")
        k = k.astype(bool)
        if not k.any():
            raise ValueError("keep_rows would drop every row; call agent.reset(batch) to start over")
        if k.all():
            return
        rows = torch.as_tensor(k, device=self.device)
        self.engine.keep_rows(rows)
        self.rtg, self.t, self.prev_action = self.rtg[rows], self.t[rows], self.prev_action[rows]
        self.first = self.first[rows]
        self._any_first = bool(self.first.any())
        self.batch = int(k.sum())

    def _require_reset(self):
        if self.engine is None:
            raise RuntimeError("call agent.reset(batch) before agent.act / agent.reset_done")

    # -- acting -----------------------------------------------------------------------------------
    def _obs(self, obs) -> torch.Tensor:
        o = torch.as_tensor(np.asarray(obs, dtype=np.float32) if not isinstance(obs, torch.Tensor) else obs)
        if o.shape != (self.batch, self.state_dim):
            raise ValueError(f"obs must have shape [batch={self.batch}, state_dim={self.state_dim}], "
                             f"got {tuple(o.shape)}")
        return o.to(self.device, torch.float32)

    def act_tensor(self, obs, reward=None) -> torch.Tensor:
        """As ``act`` but returns a tensor on the model's device."""
        self._require_reset()
        o = self._obs(obs)
        r = None
        if reward is not None:
            r = torch.as_tensor(np.asarray(reward, dtype=np.float32) if not isinstance(reward, torch.Tensor)
                                else reward).to(self.device, torch.float32)
            if r.shape != (self.batch,):
                raise ValueError(f"reward must have shape [batch={self.batch}], got {tuple(r.shape)}")
        if self.engine_name == "stream":  # the step does the bookkeeping: normalisation, return-to-go, timesteps
            return self.engine.act(o, r)
        if r is not None:
            self.rtg -= torch.where(self.first, 0.0, r / self.reward_scale)
        first = self.first if self._any_first else None
        s = ((o - self.mean) / self.std).to(self.dtype)
        action = self.engine.step(self.rtg, s, self.prev_action, self.t, first)
        self.prev_action = action.clone()
        self.t += 1
        if self._any_first:
            self.first.zero_()
            self._any_first = False
        return action

    def act(self, obs, reward=None) -> np.ndarray:
        """One action per row ([B, act_dim] float32 numpy) for observations ``obs`` [B, state_dim];
        ``reward`` [B] is the reward of the previous step (None at the first step)."""
        return self.act_tensor(obs, reward).float().cpu().numpy()

    @property
    def timesteps(self) -> np.ndarray:
        return (self.engine.timesteps if self.engine_name == "stream" else self.t).cpu().numpy().copy()

    @property
    def returns_to_go(self) -> np.ndarray:
        """Current R_t per row, unscaled (raw return units)."""
        rtg = self.engine.returns_to_go if self.engine_name == "stream" else self.rtg
        return (rtg.double() * self.reward_scale).cpu().numpy()


def load_agent(checkpoint, engine: str = "stream", *, target: float | Sequence[float] | None = None,
               device: str | torch.device = "cpu", context: int | None = None, data=None,
               precision: str = "fp32") -> Agent:
    """An agent for a DT checkpoint written by ``primal_dt.train``: a file, its run directory (its
    last.pt), a checkpoint dict or an ``agents.dt_checkpoint.DTCheckpoint``. Files are read without
    running code (``weights_only=True``).

    ``target`` defaults to the checkpoint's first evaluation target (or, for a checkpoint that
    recorded none, its environment's first: ``envs.get_spec(env).targets``). ``agent.info`` is the
    checkpoint's ``DataInfo`` (env, simulator, statistics, targets, data source and fingerprint).

    ``data``: also make sure the checkpoint belongs to a dataset: ``True`` (read it where its run
    read it), a source to read it from (``"auto"``, ``"d4rl:PATH"``, ... as ``primal_dt.train``'s
    ``data_source``) or an ``envs.Trajectories``. Data whose content differs from what the
    checkpoint was trained on is a ValueError naming both sources (``agents.dt_checkpoint.check_data``).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    ck = dt_checkpoint.load(checkpoint)
    if data is True or isinstance(data, str):
        dt_checkpoint.training_data(ck, None if data is True else data)
    elif data is not None and data is not False:
        dt_checkpoint.check_data(ck.data, data, ck.origin)
    info = ck.data
    agent = Agent(ck.build_model(device), state_mean=info.state_mean, state_std=info.state_std,
                  reward_scale=info.reward_scale, target=info.eval_targets[0] if target is None else target,
                  engine=engine, context=context, precision=precision)
    agent.info = info
    return agent
