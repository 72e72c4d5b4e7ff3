"""Evaluation lanes whose agents run in the lanes' own processes (``eval.simulators.run_hosted``): the
same episodes as agents acting in the evaluator, jobs shared through the evaluator's queue, progress and
failures reported back, each lane on its share of the cores, and a clean process where a lane runs more
than one torch thread. Real Hopper simulators, real processes."""

import time

import numpy as np
import pytest

from agents import Agent, DataInfo
from eval import rollout
from eval.episodes import run_episodes
from eval.simulators import SimulatorProcess, hostable

JOBS = [(t, e) for t in (3600.0, 1800.0) for e in range(5)]  # 10 episodes on 2 x 2 simulators: the queue is shared


def agents_for(model, stats, n=2):
    mean, std = stats
    return [Agent(model, DataInfo("hopper-medium", mean, std, reward_scale=1000.0, targets=(3600.0,))) for _ in range(n)]


def run(model, stats, venvs, host=True, **kw):
    agents = agents_for(model, stats, len(venvs))
    try:
        return run_episodes(agents, venvs, JOBS, seed=3, max_steps=49, host=host, **kw), agents
    finally:
        for v in venvs:
            v.close()


def test_a_hosted_lane_runs_the_same_episodes_as_an_agent_acting_here(tiny_dt, hopper_stats):
    """One lane, so the same rows meet the same jobs in the same order: identical trajectories whether
    the agent acts in the lane's process, here beside a lane process, or here on a plain vector env."""
    model = tiny_dt("primal+dt", K=5)
    hosted, agents = run(model, hopper_stats, [SimulatorProcess("hopper-medium", 3)])
    here, _ = run(model, hopper_stats, [rollout.vector_env("hopper-medium", 3, False, None)])
    stepped, _ = run(model, hopper_stats, [SimulatorProcess("hopper-medium", 3)], host=False)
    assert "lane_threads" in hosted and "lane_threads" not in here and "lane_threads" not in stepped
    assert agents[0].batch == 0, "the evaluator's own agent never acted: the lane's copy did"
    lengths = np.array(hosted["lengths"])
    assert (lengths < 49).any() and (lengths == 49).any(), "the test wants both kinds of episode end"
    for other in (here, stepped):
        assert hosted["lengths"] == other["lengths"] and hosted["act_rows"] == other["act_rows"]
        np.testing.assert_array_equal(hosted["returns"], other["returns"])


class SlowAgent(Agent):
    """An agent that takes ``delay`` seconds longer per step: skews the lanes' timing."""

    delay = 0.0

    def act(self, obs, reward=None):
        time.sleep(self.delay)
        return super().act(obs, reward)


def test_hosted_lanes_share_one_queue_in_a_timing_free_order(tiny_dt, hopper_stats):
    """Two lanes take jobs from the evaluator's queue as their episodes end, answered in (step, lane)
    order: the same rows get the same jobs as with in-process lanes, even when one lane runs much slower
    than the other, so every batch and every result is identical. Every job runs once, progress adds
    up, each lane reports its thread count."""
    model = tiny_dt("primal+dt", K=5)
    mean, std = hopper_stats
    here, _ = run(model, hopper_stats, [rollout.vector_env("hopper-medium", 2, False, None) for _ in range(2)])
    for slow_lane in (0, 1):
        agents = [SlowAgent(model, DataInfo("hopper-medium", mean, std, reward_scale=1000.0, targets=(3600.0,)))
                  for _ in range(2)]
        agents[slow_lane].delay = 0.003
        venvs = [SimulatorProcess("hopper-medium", 2) for _ in range(2)]
        ended = []
        try:
            hosted = run_episodes(agents, venvs, JOBS, seed=3, max_steps=49, on_episode=ended.append)
        finally:
            for v in venvs:
                v.close()
        assert "lane_threads" in hosted and all(a.batch == 0 for a in agents)
        assert hosted["lengths"] == here["lengths"] and sorted(hosted["act_rows"]) == sorted(here["act_rows"])
        np.testing.assert_array_equal(hosted["returns"], here["returns"])
        assert len(set(np.round(hosted["returns"], 4))) == len(JOBS)  # every job ran once, its own episode
        assert sum(ended) == len(JOBS) and min(ended) >= 1
        assert hosted["env_steps"] == sum(hosted["act_rows"]) == sum(hosted["lengths"])
        assert hosted["lane_threads"] == [1, 1]


def test_an_agent_that_cannot_travel_acts_here(tiny_dt, hopper_stats):
    model = tiny_dt("primal+dt", K=5)
    agents = agents_for(model, hopper_stats)
    agents[0].note = lambda: None  # not picklable
    assert hostable(agents[0]) is None and hostable(agents[1]) is not None
    venvs = [SimulatorProcess("hopper-medium", 2) for _ in range(2)]
    try:
        res = run_episodes(agents, venvs, JOBS[:4], seed=3, max_steps=20)
    finally:
        for v in venvs:
            v.close()
    assert "lane_threads" not in res and len(res["returns"]) == 4


def test_a_failing_lane_is_reported_and_every_lane_process_ends(tiny_dt, hopper_stats):
    """An agent for another observation size fails in its lane process: the evaluator raises the agent's
    own error, and closing the lanes leaves no process behind."""
    walker = tiny_dt("primal+dt", K=5)  # hopper-sized (11 observations) ...
    mean, std = hopper_stats
    agents = [Agent(walker, DataInfo("hopper-medium", mean, std, reward_scale=1000.0, targets=(3600.0,))) for _ in range(2)]
    venvs = [SimulatorProcess("walker2d-medium", 2) for _ in range(2)]  # ... on 17-observation simulators
    try:
        with pytest.raises(ValueError, match="obs must have shape"):
            run_episodes(agents, venvs, JOBS, seed=0, max_steps=10)
    finally:
        for v in venvs:
            v.close()
    assert not any(v._proc.is_alive() for v in venvs)


@pytest.mark.slow
def test_a_multi_threaded_lane_starts_clean_and_uses_its_threads(run_code):
    """A lane with 2 torch threads, made by a parent that already ran a 2-thread parallel region (a forked
    child would hang in GNU OpenMP), runs its episodes on 2 threads in a freshly started process."""
    code = """
import torch
torch.set_num_threads(2)
(torch.randn(512, 512) @ torch.randn(512, 512)).sum()  # the parent's OpenMP pool exists now
from agents import Agent, DataInfo
from agents.decision_transformer import DecisionTransformer, DTConfig
from eval.episodes import run_episodes
from eval.simulators import SimulatorProcess
import numpy as np
m = DecisionTransformer(DTConfig(state_dim=11, act_dim=3, K=4, d_model=16, n_heads=2, s=4, dropout=0.0)).eval()
agents = [Agent(m, DataInfo("hopper-medium", np.zeros(11), np.ones(11), reward_scale=1000.0, targets=(3600.0,)))]
venvs = [SimulatorProcess("hopper-medium", 2, threads=2)]
try:
    res = run_episodes(agents, venvs, [(3600.0, 0), (3600.0, 1)], seed=0, max_steps=15)
finally:
    venvs[0].close()
print("lane", type(venvs[0]._proc).__name__, res["lane_threads"], len(res["returns"]))
"""
    p = run_code(code, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "lane ForkServerProcess [2] 2" in p.stdout
