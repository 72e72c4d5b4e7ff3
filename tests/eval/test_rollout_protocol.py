"""The vectorised evaluator (recompute engine) against the papers' one-episode-at-a-time loop in real Hopper."""

import dataclasses

import numpy as np
import pytest
import torch

import envs
from agents import DataInfo, DecisionTransformer, DTConfig
from agents.decision_transformer import Batch
from eval.rollout import evaluate
from agents.train_config import RolloutOptions

K = 4


def tiny_model(seed):
    torch.manual_seed(seed)
    m = DecisionTransformer(DTConfig(state_dim=11, act_dim=3, K=K, d_model=32, n_heads=2, n_layers=2,
                                     name="primal+dt", s=8, dropout=0.0))
    with torch.no_grad():  # large actions that depend on the target, so episodes end at different steps
        m.action_head[0].weight.mul_(8)
        m.embed_return.weight.mul_(300)
    return m


def naive_episode(model, seed, target, mean, std, scale, max_steps):
    """The papers' loop: keep the whole history, feed the last K steps, take the last action."""
    env = envs.make_env("hopper-medium", seed=None)
    obs, _ = env.reset(seed=seed)
    S, A, R, T = [], [], [], []
    rtg, ret, n = target / scale, 0.0, 0
    for t in range(max_steps):
        S.append((torch.tensor(obs, dtype=torch.float32) - mean) / std)
        A.append(torch.zeros(3))
        R.append(torch.tensor([rtg], dtype=torch.float32))
        T.append(t)
        with torch.no_grad():
            pred, _ = model(Batch(torch.stack(S[-K:])[None], torch.stack(A[-K:])[None], torch.stack(R[-K:])[None],
                                  torch.tensor(T[-K:])[None]))
        A[-1] = pred[0, -1]
        obs, rew, term, trunc, _ = env.step(A[-1].numpy())
        ret, n = ret + rew, n + 1
        rtg = float(np.float32(rtg) - np.float32(rew / scale))
        if term or trunc:
            break
    env.close()
    return ret, n


def test_matches_a_plain_rollout_and_is_deterministic():
    mean, std = torch.linspace(-0.5, 0.5, 11), torch.linspace(0.5, 2.0, 11)
    data = DataInfo("hopper-medium", mean.numpy(), std.numpy(), reward_scale=1000.0)
    options = RolloutOptions(targets=(3600, -3600), max_steps=40, num_envs=4, engine="recompute")
    for seed in range(10):  # the first initialisation whose episodes end at different steps
        model = tiny_model(seed)
        res = evaluate(model, 3, 11, options, data=data)
        lengths = [n for r in res.values() for n in r["lengths"]]
        if len(set(lengths)) > 1 and max(lengths) > K:
            break
    assert len(set(lengths)) > 1 and max(lengths) > K  # finished rows and the rolling window are exercised
    assert set(res) == {3600.0, -3600.0}
    for target, r in res.items():
        assert len(r["returns"]) == 3
        for e in range(3):
            ret, n = naive_episode(model, 11 + e, target, mean, std, 1000.0, 40)
            assert r["lengths"][e] == n
            assert r["returns"][e] == pytest.approx(ret, rel=1e-5)
        np.testing.assert_allclose(r["normalized"], envs.normalized_score("hopper-medium", r["returns"]))
    assert evaluate(model, 3, 11, options, data=data) == res  # deterministic
    again = evaluate(model, 3, 11, dataclasses.replace(options, num_envs=6), data=data)
    for t in res:  # other batching: the same episodes up to float rounding
        assert again[t]["lengths"] == res[t]["lengths"]
        np.testing.assert_allclose(again[t]["returns"], res[t]["returns"], rtol=1e-4)
    assert model.training  # the caller's mode is restored
