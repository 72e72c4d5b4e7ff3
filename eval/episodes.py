"""The episode loop behind ``eval.rollout``: many episodes at once, simulation overlapped with inference.

Simulators are split into *lanes*, each a Gymnasium vector env with its own agent (the same model).
While one lane's simulators step, the next lane's agent computes its actions, so on a 2-core machine
simulation hides behind inference instead of adding to it. A lane steps in its own process
(``eval.simulators.SimulatorProcess``: true parallelism) or in a worker thread (plain vector envs:
torch ops release the GIL, but the simulators' Python code does not). With one lane (and for
subprocess vector envs, whose simulators already run beside the agent) the loop is the plain
act-then-step one.

Jobs (target, episode index) come from one shared queue: a simulator whose episode ends is reset
with the next job's own seed (``seed + episode index``) and its agent row restarted; when no job is
left the row leaves its agent's batch (``agent.keep_rows``) and the simulator is no longer stepped,
so the tail of an evaluation, where a few long episodes run on, costs only those rows. An episode's
outcome depends only on its seed and target, never on lane, row or ``num_envs``.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import gymnasium as gym
import numpy as np


def step_rows(venv, envs_idx: np.ndarray, actions: np.ndarray):
    """Step the simulators ``envs_idx`` with ``actions``; their (obs, reward, terminated, truncated).
    A SyncVectorEnv with idle simulators steps only the busy ones; an AsyncVectorEnv steps every
    subprocess, idle ones with zero actions."""
    n = venv.num_envs
    if len(envs_idx) < n and isinstance(venv, gym.vector.SyncVectorEnv):
        out = [venv.envs[i].step(a) for i, a in zip(envs_idx, actions)]
        return (np.stack([o[0] for o in out]), np.array([o[1] for o in out], dtype=np.float64),
                np.array([o[2] for o in out], dtype=bool), np.array([o[3] for o in out], dtype=bool))
    full = np.zeros((n,) + actions.shape[1:], dtype=actions.dtype)
    full[envs_idx] = actions
    obs, reward, term, trunc, _ = venv.step(full)
    return obs[envs_idx], reward[envs_idx], term[envs_idx], trunc[envs_idx]


class _Lane:
    """One vector env and its agent; agent row k drives simulator ``running[k]``."""

    def __init__(self, agent, venv):
        self.agent, self.venv = agent, venv
        n = venv.num_envs
        self.job: list[int | None] = [None] * n
        self.ep_ret, self.ep_len = np.zeros(n), np.zeros(n, dtype=np.int64)
        self.running = np.zeros(0, dtype=np.int64)
        self.obs = self.reward = None

    def start(self, queue: deque, seed: int) -> None:
        n = self.venv.num_envs
        seeds, targets = [], []
        for i in range(n):
            if queue:
                j, (tgt, e) = queue.popleft()
                self.job[i] = j
                seeds.append(seed + e)
                targets.append(float(tgt))
            else:  # no job: reset (the vector env wants every seed) but never stepped
                seeds.append(seed + 10**6 + i)
        obs, _ = self.venv.reset(seed=seeds)
        self.running = np.array([i for i in range(n) if self.job[i] is not None], dtype=np.int64)
        if len(self.running):
            self.agent.reset(len(self.running), target=targets)
            self.obs = obs[self.running]

    def finish(self, stepped, queue: deque, seed: int, returns: np.ndarray, lengths: np.ndarray,
               max_steps: int) -> None:
        """Take a step's results: record ended episodes, restart rows with new jobs, drop the rest."""
        self.obs, self.reward, term, trunc = stepped
        run = self.running
        self.ep_ret[run] += self.reward
        self.ep_len[run] += 1
        ended = term | trunc | (self.ep_len[run] >= max_steps)
        if not ended.any():
            return
        restart = np.zeros(self.venv.num_envs, dtype=bool)
        new_seeds: list[int | None] = [None] * self.venv.num_envs
        new_targets, keep = [], np.ones(len(run), dtype=bool)
        for k in np.flatnonzero(ended):
            i = run[k]
            returns[self.job[i]], lengths[self.job[i]] = self.ep_ret[i], self.ep_len[i]
            self.ep_ret[i], self.ep_len[i] = 0.0, 0
            if queue:
                j, (tgt, e) = queue.popleft()
                self.job[i], new_seeds[i], restart[i] = j, seed + e, True
                new_targets.append(float(tgt))
            else:
                self.job[i], keep[k] = None, False
        if restart.any():
            fresh, _ = self.venv.reset(seed=new_seeds, options={"reset_mask": restart})
            again = restart[run]
            self.obs[again] = fresh[run[again]]
            self.agent.reset_done(again, target=new_targets)
        if not keep.all():
            self.running, self.obs, self.reward = run[keep], self.obs[keep], self.reward[keep]
            if len(self.running):
                self.agent.keep_rows(keep)


def run_episodes(agents, venvs, jobs: Sequence[tuple[float, int]], seed: int, max_steps: int,
                 on_step: Callable[[int], None] | None = None) -> dict:
    """Run every (target, episode index) job to its end; ``agents`` / ``venvs``: one each, or one
    per lane (vector envs with autoreset DISABLED).

    Returns {"returns": [...], "lengths": [...]} in job order, "act_s" and "act_rows": the duration
    and batch of every ``agent.act`` call, "env_steps": environment steps taken.
    """
    agents = list(agents) if isinstance(agents, (list, tuple)) else [agents]
    venvs = list(venvs) if isinstance(venvs, (list, tuple)) else [venvs]
    if len(agents) != len(venvs) or not agents:
        raise ValueError(f"one agent per vector env: got {len(agents)} agents for {len(venvs)} vector envs")
    queue = deque(enumerate(jobs))
    lanes = [_Lane(a, v) for a, v in zip(agents, venvs)]
    for lane in lanes:
        lane.start(queue, seed)
    returns = np.zeros(len(jobs))
    lengths = np.zeros(len(jobs), dtype=np.int64)
    act_s: list[float] = []
    act_rows: list[int] = []
    env_steps = 0
    in_process = all(hasattr(v, "step_rows_async") for v in venvs)
    pool = ThreadPoolExecutor(1, thread_name_prefix="simulators") if len(lanes) > 1 and not in_process else None
    pending = None  # (lane, a function returning its step): a lane whose simulators are stepping

    def submit(lane, action):
        if in_process:  # eval.simulators: the lane's own process steps while we go on
            lane.venv.step_rows_async(lane.running, action)
            return lane.venv.step_rows_wait
        if pool is not None:
            return pool.submit(step_rows, lane.venv, lane.running, action).result
        out = step_rows(lane.venv, lane.running, action)
        return lambda: out

    def finish(p):
        lane, result = p
        lane.finish(result(), queue, seed, returns, lengths, max_steps)

    try:
        while any(len(lane.running) for lane in lanes):
            for lane in lanes:
                if pending is not None and pending[0] is lane:
                    finish(pending)
                    pending = None
                if not len(lane.running):
                    continue
                t0 = time.perf_counter()
                action = lane.agent.act(lane.obs, lane.reward)
                act_s.append(time.perf_counter() - t0)
                act_rows.append(len(lane.running))
                env_steps += len(lane.running)
                if on_step is not None:
                    on_step(len(lane.running))
                if pending is not None:  # the previous lane's simulators ran while this lane acted
                    finish(pending)
                pending = (lane, submit(lane, action))
        if pending is not None:
            finish(pending)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return {"returns": returns.tolist(), "lengths": lengths.tolist(), "act_s": act_s, "act_rows": act_rows,
            "env_steps": env_steps}
