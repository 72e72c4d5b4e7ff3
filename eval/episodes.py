"""The episode loop behind ``eval.rollout``: many episodes at once, simulation overlapped with inference.

Simulators are split into *lanes*, each a Gymnasium vector env with its own agent (the same model). With
lane processes (``eval.simulators``) and a CPU agent, the whole act-then-step loop of a lane runs in its
process, one core per lane. Otherwise the agents act here, and while one lane's simulators step in its
process the next lane's agent computes. Jobs (target, episode index) come from one queue: a finished
simulator is reset with the next job's seed (``seed + episode index``) and its agent row restarted; with no
job left the row leaves the batch, so the tail of an evaluation costs only its long episodes. An episode's
outcome depends only on its seed and target, never on lane, row or ``num_envs``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Sequence

import gymnasium as gym
import numpy as np


def vector_env(name: str, num_envs: int, asynchronous: bool = False, gym_id: str | None = None):
    """``num_envs`` simulators of ``name``, autoreset disabled (the episode loop resets each one itself)."""
    from envs import make_vector_env

    return make_vector_env(name, num_envs, None, asynchronous, gym_id=gym_id,
                           autoreset_mode=gym.vector.AutoresetMode.DISABLED)


def step_rows(venv, envs_idx: np.ndarray, actions: np.ndarray):
    """(obs, reward, terminated, truncated) of the simulators ``envs_idx`` stepped with ``actions``: only
    those on a SyncVectorEnv; every one on an AsyncVectorEnv, idle ones with zero actions."""
    n = venv.num_envs
    if len(envs_idx) < n and isinstance(venv, gym.vector.SyncVectorEnv):
        obs, reward, term, trunc, _ = zip(*[venv.envs[i].step(a) for i, a in zip(envs_idx, actions)])
        return np.stack(obs), np.array(reward, np.float64), np.array(term, bool), np.array(trunc, bool)
    full = np.zeros((n,) + actions.shape[1:], dtype=actions.dtype)
    full[envs_idx] = actions
    obs, reward, term, trunc, _ = venv.step(full)
    return obs[envs_idx], reward[envs_idx], term[envs_idx], trunc[envs_idx]


class Jobs(deque):
    """The evaluator's job queue, ``(job index, (target, episode))`` in order: ``take(step, n)`` hands up to
    ``n`` jobs to a lane at its ``step``. Lanes take in (step, lane) order, in-process or not, so every batch
    an agent sees does not depend on timing."""

    def __init__(self, jobs):
        super().__init__(enumerate(jobs))

    def take(self, step: int, n: int) -> list:
        return [self.popleft() for _ in range(min(n, len(self)))]


class _Lane:
    """One vector env and its agent; agent row k drives simulator ``running[k]``."""

    def __init__(self, agent, venv):
        self.agent, self.venv = agent, venv
        n = venv.num_envs
        self.job: list[int | None] = [None] * n
        self.ep_ret, self.ep_len = np.zeros(n), np.zeros(n, dtype=np.int64)
        self.running = np.zeros(0, dtype=np.int64)
        self.obs = self.reward = None
        self.steps = 0

    def start(self, jobs: Jobs, seed: int) -> None:
        n = self.venv.num_envs
        got = jobs.take(0, n)  # row i < len(got) runs job got[i]
        self.job[:len(got)] = [j for j, _ in got]
        # a row without a job is reset too (the vector env wants every seed), but never stepped
        obs, _ = self.venv.reset(seed=[seed + e for _, (_, e) in got] + [seed + 10**6 + i for i in range(len(got), n)])
        self.running = np.arange(len(got), dtype=np.int64)
        if len(got):
            self.agent.reset(len(got), target=[float(t) for _, (t, _) in got])
            self.obs = obs[self.running]

    def finish(self, stepped, jobs: Jobs, seed: int, returns: np.ndarray, lengths: np.ndarray, max_steps: int) -> int:
        """Take a step's results: record ended episodes, restart rows with new jobs (the first ended rows
        get them, in row order), drop the rest; returns how many episodes ended."""
        self.obs, self.reward, term, trunc = stepped
        self.steps += 1
        run = self.running
        self.ep_ret[run] += self.reward
        self.ep_len[run] += 1
        ended = term | trunc | (self.ep_len[run] >= max_steps)
        got = iter(jobs.take(self.steps, int(ended.sum())))
        if not ended.any():
            return 0
        restart = np.zeros(self.venv.num_envs, dtype=bool)
        new_seeds: list[int | None] = [None] * self.venv.num_envs
        new_targets, keep = [], np.ones(len(run), dtype=bool)
        for k in np.flatnonzero(ended):
            i = run[k]
            returns[self.job[i]], lengths[self.job[i]] = self.ep_ret[i], self.ep_len[i]
            self.ep_ret[i], self.ep_len[i] = 0.0, 0
            job = next(got, None)
            if job is not None:
                j, (tgt, e) = job
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
        return int(ended.sum())


def run_lanes(agents, venvs, jobs, seed: int, max_steps: int, returns, lengths,
              on_episode: Callable[[int], None] | None = None) -> dict:
    """The act-then-step loop of every evaluator (a lane process runs it for its one lane): each lane's agent
    acts for its running rows, its simulators step (a lane process's while the next lane acts), and the outcome
    restarts or drops rows. A lane's step is taken in only after the next lane has acted. Outcomes go to
    ``returns[job]`` / ``lengths[job]``; returns "act_s", "act_rows" and "env_steps" as ``run_episodes`` does."""
    lanes = [_Lane(a, v) for a, v in zip(agents, venvs)]
    for lane in lanes:
        lane.start(jobs, seed)
    act_s, act_rows = [], []  # duration and batch of every act
    pending = None  # (lane, its step's result or a function returning it): a lane whose simulators are stepping

    def finish(p):
        lane, result = p
        ended = lane.finish(result() if callable(result) else result, jobs, seed, returns, lengths, max_steps)
        if ended and on_episode is not None:
            on_episode(ended)

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
            if pending is not None:  # the previous lane's simulators ran while this lane acted
                finish(pending)
            if hasattr(lane.venv, "step_rows_async"):  # eval.simulators: its process steps while we go on
                lane.venv.step_rows_async(lane.running, action)
                pending = (lane, lane.venv.step_rows_wait)
            else:
                pending = (lane, step_rows(lane.venv, lane.running, action))
    if pending is not None:
        finish(pending)
    return {"act_s": act_s, "act_rows": act_rows, "env_steps": sum(act_rows)}


def run_episodes(agents, venvs, jobs: Sequence[tuple[float, int]], seed: int, max_steps: int,
                 on_episode: Callable[[int], None] | None = None, host: bool = True) -> dict:
    """Run every (target, episode index) job to its end; ``agents`` / ``venvs``: one each, or one per lane
    (vector envs with autoreset disabled); anything with the ``agents.onnx_policy.Policy`` API acts.
    ``on_episode(n)`` is called as ``n`` episodes end. Returns {"returns", "lengths"} in job order, "act_s"
    and "act_rows" (duration and batch of every ``act``), "env_steps"; with hosted lanes also "lane_threads".
    ``host=False`` keeps the agents here even with lane processes."""
    agents = list(agents) if isinstance(agents, (list, tuple)) else [agents]
    venvs = list(venvs) if isinstance(venvs, (list, tuple)) else [venvs]
    if len(agents) != len(venvs) or not agents:
        raise ValueError(f"one agent per vector env: got {len(agents)} agents for {len(venvs)} vector envs")
    if host and all(hasattr(v, "host_agents") for v in venvs):  # lane processes (eval.simulators): agents go there
        hosted = venvs[0].host_agents(agents, venvs, jobs, seed, max_steps, on_episode)
        if hosted is not None:
            return hosted
    returns = np.zeros(len(jobs))
    lengths = np.zeros(len(jobs), dtype=np.int64)
    out = run_lanes(agents, venvs, Jobs(jobs), seed, max_steps, returns, lengths, on_episode)
    return {"returns": returns.tolist(), "lengths": lengths.tolist(), **out}
