"""A small D4RL-format HDF5 file of real Hopper-v4 rollouts, so trainer tests run on real
simulator data through the real loader (``data_source=d4rl:PATH``) in well under a second."""

import h5py
import numpy as np
import pytest


def hopper_rollouts(episodes: int = 24, max_steps: int = 120, seed: int = 0) -> dict:
    """Episodes of a noisy open-loop policy in Hopper-v4, in D4RL's flat layout."""
    import gymnasium as gym

    env = gym.make("Hopper-v4")
    rng = np.random.default_rng(seed)
    cols = {k: [] for k in ("observations", "actions", "rewards", "terminals", "timeouts")}
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        bias = rng.uniform(-0.5, 0.5, size=3)
        for t in range(max_steps):
            act = np.clip(bias + 0.3 * rng.standard_normal(3), -1, 1).astype(np.float32)
            nxt, rew, term, trunc, _ = env.step(act)
            timeout = not term and t == max_steps - 1
            for k, v in zip(cols, (obs, act, rew, term, timeout)):
                cols[k].append(v)
            obs = nxt
            if term or timeout:
                break
    env.close()
    return {k: np.asarray(v) for k, v in cols.items()}


@pytest.fixture(scope="session")
def hopper_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "hopper_rollouts-v2.hdf5"
    with h5py.File(path, "w") as f:
        for k, v in hopper_rollouts().items():
            f.create_dataset(k, data=v.astype(bool if k in ("terminals", "timeouts") else np.float32))
    return path
