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


@pytest.fixture(scope="session")
def engines_agree(make_agent, rollout_inputs, run_agent, hopper_stats):
    """engines_agree(model, episode): both engines act 12 steps for 2 rows (row 1 restarts at step 6, its first
    reward input the old episode's); each row's stream actions must be the streamed-equivalent model's forward
    over its episode so far, and recompute (context K) must show the first K steps the same tokens.
    ``episode(S, A, r)`` -> the ``Batch`` [1, T] of a row's episode from its normalised states, its actions and
    its rewards [1, T, 1] (r_i: the reward after a_i, the next step's input); its timesteps are 0 .. T - 1."""
    import torch

    from agents.decision_transformer import streamed_model_equivalent

    def check(model, episode):
        obs, rew = rollout_inputs(T=12, B=2)
        resets = {6: np.array([False, True])}
        stream, recompute = make_agent(model, "stream"), make_agent(model, "recompute")
        stream.reset(2), recompute.reset(2)
        acts, recomputed = run_agent(stream, obs, rew, resets), run_agent(recompute, obs, rew, resets)
        mean, std = hopper_stats
        twin, K = streamed_model_equivalent(model), model.cfg.K
        for row, start in ((0, 0), (1, 6)):
            S = torch.as_tensor((obs[start:, row] - mean) / std)[None]
            with torch.no_grad():
                ref, _ = twin(episode(S, torch.as_tensor(acts[start:, row])[None],
                                      torch.as_tensor(rew[start:, row])[None, :, None]))
            np.testing.assert_allclose(acts[start:, row], ref[0].numpy(), atol=1e-5, rtol=0)
            np.testing.assert_allclose(recomputed[start:start + K, row], acts[start:start + K, row], atol=1e-5, rtol=0)

    return check


@pytest.fixture(scope="session")
def export_agrees(dt_checkpoint_file, make_agent, rollout_inputs, run_agent):
    """export_agrees(model, directory) -> (checkpoint, graph): ``model`` written as a checkpoint file there and
    exported to ONNX, whose ``OnnxPolicy`` must act as the torch stream agent (to 1e-5) for 10 steps of 3 rows,
    row 1 restarting at step 5."""
    from agents.export import export_policy
    from agents.onnx_policy import OnnxPolicy

    def check(model, directory):
        ck = dt_checkpoint_file(directory, model)
        path = export_policy(ck, "onnx")
        obs, rew = rollout_inputs(T=10, B=3)
        resets = {5: np.array([False, True, False])}
        agent, policy = make_agent(model, "stream"), OnnxPolicy(path)
        agent.reset(3), policy.reset(3)
        np.testing.assert_allclose(run_agent(policy, obs, rew, resets), run_agent(agent, obs, rew, resets),
                                   atol=1e-5, rtol=0)
        return ck, path

    return check
