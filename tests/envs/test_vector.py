"""Simulators for dataset names: real Gymnasium Hopper rollouts."""

import gymnasium as gym
import numpy as np

from envs import make_env, make_vector_env


def _rollout(env, actions):
    obs, rews = [], []
    for a in actions:
        o, r, term, trunc, _ = env.step(a)
        obs.append(o)
        rews.append(r)
        if term or trunc:
            break
    return np.array(obs), np.array(rews)


def test_make_env_gives_the_d4rl_simulator_and_is_seeded():
    env = make_env("hopper-medium", seed=3)
    assert env.spec.id == "Hopper-v4" and env.observation_space.shape == (11,)
    acts = np.random.default_rng(0).uniform(-1, 1, (30, 3))
    o1, r1 = _rollout(env, acts)
    env2 = make_env("hopper-medium", seed=3)
    o2, r2 = _rollout(env2, acts)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(r1, r2)
    # a plain reset() afterwards continues a seeded stream: equal across the two envs too
    np.testing.assert_array_equal(env.reset()[0], env2.reset()[0])
    other = make_env("hopper-medium", seed=4).reset()[0]
    assert not np.array_equal(other, make_env("hopper-medium", seed=3).reset(seed=3)[0])
    assert make_env("hopper-medium", gym_id="Hopper-v5").spec.id == "Hopper-v5"
    assert make_env("ant-medium").observation_space.shape == (111,)  # D4RL's ant observation


def test_vector_env_steps_a_batch():
    venv = make_vector_env("hopper-medium", num_envs=3, seed=0)
    assert isinstance(venv, gym.vector.SyncVectorEnv) and venv.num_envs == 3
    obs, _ = venv.reset(seed=[0, 1, 2])
    single = make_env("hopper-medium", seed=None).reset(seed=1)[0]
    np.testing.assert_array_equal(obs[1], single)  # env i is the seed-i simulator
    total = np.zeros(3)
    for _ in range(20):
        obs, r, term, trunc, _ = venv.step(np.zeros((3, 3)))
        total += r
    assert obs.shape == (3, 11) and (total > 0).all()
    venv.close()


def test_async_vector_env_matches_sync():
    sync = make_vector_env("hopper-medium", num_envs=2, seed=5)
    asyn = make_vector_env("hopper-medium", num_envs=2, seed=5, asynchronous=True)
    assert isinstance(asyn, gym.vector.AsyncVectorEnv)
    a = np.full((2, 3), 0.2)
    for _ in range(5):
        o1, r1, *_ = sync.step(a)
        o2, r2, *_ = asyn.step(a)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(r1, r2)
    sync.close()
    asyn.close()
