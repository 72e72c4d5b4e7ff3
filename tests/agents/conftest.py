"""What the agent and engine tests share: the layouts every engine is checked on, agents with the
hopper bookkeeping, and a driver that plays observation / reward sequences into an agent."""

import numpy as np
import pytest

from agents import Agent


@pytest.fixture(scope="session")
def layout_cases():
    """name -> (layout, options): one model per kind of per-layer recurrent state (prefix sums,
    ring buffers, a KV cache, the linear family's generic state)."""
    return {
        "primalformer": ("primalformer-dt", {"primal": {"s": 8}}),
        "primal+dt": ("primal+dt", {"primal": {"s": 8}}),
        "dt": ("dt", {}),
        "windowed": ("primal+dt", {"primal": {"s": 8, "window": 10}, "softmax": {"window": 7}}),
        "window<chunk": ("primalformer-dt", {"primal": {"s": 8, "window": 2}}),
        "performer": ("performer", {}),
        "cosformer": ("cosformer", {}),
    }


@pytest.fixture(scope="session")
def make_agent(hopper_info):
    """make_agent(model, engine, **Agent options): an agent with the hopper bookkeeping (``hopper_info``)."""
    def make(model, engine, **kw):
        return Agent(model, hopper_info, engine=engine, **kw)

    return make


@pytest.fixture(scope="session")
def rollout_inputs():
    """rollout_inputs(T=25, B=3, seed=1) -> (obs [T, B, 11], rewards [T, B]) float32."""
    def make(T=25, B=3, seed=1):
        g = np.random.default_rng(seed)
        return g.normal(size=(T, B, 11)).astype(np.float32), g.uniform(0, 3, size=(T, B)).astype(np.float32)

    return make


@pytest.fixture(scope="session")
def run_agent():
    """run_agent(agent, obs, rew, resets=None) -> actions [T, B, act]: act on obs[t] with the
    previous step's reward; ``resets``: {t: done mask applied (reset_done) before step t}."""
    def run(agent, obs, rew, resets=None):
        acts, reward = [], None
        for t in range(obs.shape[0]):
            if resets and t in resets:
                agent.reset_done(resets[t])
            acts.append(agent.act(obs[t], reward))
            reward = rew[t]
        return np.stack(acts)

    return run
