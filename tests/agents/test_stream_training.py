"""Stream-exact training: on a model with every layer windowed, the stream agent in a real Hopper
simulator reproduces ``model.forward`` over the whole episode, and the loss mask keeps exactly the
segment steps whose predictions equal the whole-episode (= streamed) ones."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from agents import Agent, DataInfo, DTConfig
from agents.decision_transformer import Batch
from agents.stream_training import first_exact_step, receptive_field, stream_exact_batch, stream_exact_config

W = 9  # tokens per window: 3 layers reach R = 3 * 8 = 24 tokens back


def windowed_model(tiny_dt, layout="primal+dt"):
    cfg = stream_exact_config(tiny_dt(layout).cfg, window=W)
    torch.manual_seed(0)
    from agents import DecisionTransformer

    return DecisionTransformer(cfg).eval()


def simulate(agent, T, seed=3):
    env = gym.make("Hopper-v4", terminate_when_unhealthy=False)  # a random model falls; keep simulating
    obs, _ = env.reset(seed=seed)
    agent.reset(1)
    rec = {"obs": [], "act": [], "rew": []}
    reward = None
    for _ in range(T):
        a = agent.act(obs[None], reward)[0]
        rec["obs"].append(obs), rec["act"].append(a)
        obs, r, term, trunc, _ = env.step(a)
        rec["rew"].append(r)
        reward = np.array([r], np.float32)
        if term or trunc:
            break
    env.close()
    return {k: np.asarray(v) for k, v in rec.items()}


def episode_tensors(rec, mean, std, target=3600.0, scale=1000.0):
    T = len(rec["act"])
    S = torch.as_tensor((rec["obs"] - mean) / std, dtype=torch.float32)[None]
    rtg = (target - np.concatenate([[0.0], np.cumsum(rec["rew"][:-1])])) / scale
    return (S, torch.as_tensor(rec["act"], dtype=torch.float32)[None],
            torch.as_tensor(rtg, dtype=torch.float32)[None, :, None], torch.arange(T)[None])


@pytest.mark.parametrize("layout", ["primal+dt", "dt", "primalformer-dt"])
def test_stream_agent_in_hopper_equals_forward_over_the_whole_episode(layout, tiny_dt, hopper_stats):
    m = windowed_model(tiny_dt, layout)
    mean, std = hopper_stats
    ag = Agent(m, DataInfo("hopper-medium", mean, std, reward_scale=1000.0, targets=(3600.0,)), engine="stream")
    rec = simulate(ag, T=60)
    T = len(rec["act"])
    assert T == 60  # 180 tokens: the windows (reach 24 tokens) slid far past the episode start
    S, A, R, Tt = episode_tensors(rec, mean, std)
    with torch.no_grad():
        pred, _ = m(Batch(S, A, R, Tt))
    np.testing.assert_allclose(rec["act"], pred[0].numpy(), atol=1e-5, rtol=0)


def test_loss_mask_keeps_exactly_the_steps_that_match_the_stream(tiny_dt):
    m = windowed_model(tiny_dt)
    reach = receptive_field(m)
    assert reach == 3 * (W - 1)
    first = first_exact_step(m)
    assert 3 * first + 1 >= reach > 3 * (first - 1) + 1
    K = first + 4  # 4 counted steps in a segment away from its episode's start
    g = torch.Generator().manual_seed(0)
    T = 40
    S, A = torch.randn(1, T, 11, generator=g), torch.rand(1, T, 3, generator=g) * 2 - 1
    R = torch.randn(1, T, 1, generator=g)
    Tt = torch.arange(T)[None]
    with torch.no_grad():
        full, _ = m(Batch(S, A, R, Tt))
        starts = [0, 5, 17, T - K]
        segs = [m(Batch(S[:, s:s + K], A[:, s:s + K], R[:, s:s + K], Tt[:, s:s + K]))[0] for s in starts]
    mask = torch.ones(len(starts), K, dtype=torch.bool)
    mask[-1, K - 2:] = False  # a padded tail stays excluded
    timesteps = torch.cat([Tt[:, s:s + K] for s in starts])
    loss_mask = stream_exact_batch(Batch(None, None, None, timesteps, mask), first).loss_mask
    assert loss_mask[0].all()  # the episode start: every step counts
    assert loss_mask[1].tolist() == [i >= first for i in range(K)]
    assert not loss_mask[-1, K - 2:].any()
    for row, (s, seg) in enumerate(zip(starts, segs)):
        for i in range(K):
            same = torch.allclose(seg[0, i], full[0, s + i], atol=1e-5, rtol=0)
            if loss_mask[row, i]:
                assert same, (s, i)
        if s > 0:  # the mask is not vacuous: excluded steps do differ from the stream's predictions
            assert not torch.allclose(seg[0, :first], full[0, s:s + first], atol=1e-5, rtol=0)


def test_stream_exact_config_refuses_layers_without_a_window():
    cfg = DTConfig(state_dim=11, act_dim=3, K=5, d_model=32, n_heads=2, layers="softmax,linear,primal", s=8,
                   dropout=0.0)
    with pytest.raises(ValueError, match=r"layer 1 \(linear\) has no window"):
        stream_exact_config(cfg, 9)
    with pytest.raises(ValueError, match="window must be an integer"):
        stream_exact_config(cfg, 0)
