"""Isolate every test from the user's datasets: D4RL, Minari and replica folders point into a
fresh tmp dir, the bundled replica folder too, and the Minari download is off unless a test
turns it on."""

import h5py
import numpy as np
import pytest


@pytest.fixture(autouse=True)
def data_dirs(tmp_path, monkeypatch):
    import envs.replica as replica

    dirs = {k: tmp_path / k for k in ("d4rl", "minari", "replicas", "bundled")}
    for d in dirs.values():
        d.mkdir()
    monkeypatch.setenv("D4RL_DATASET_DIR", str(dirs["d4rl"]))
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(dirs["minari"]))
    monkeypatch.setenv("PRIMAL_DT_DATA_DIR", str(dirs["replicas"]))
    monkeypatch.setenv("PRIMAL_DT_OFFLINE", "1")
    monkeypatch.setattr(replica, "BUNDLED_DIR", dirs["bundled"])
    return dirs


@pytest.fixture
def write_h5():
    return _write_h5


@pytest.fixture
def toy():
    return _toy_arrays()


def _write_h5(path, **arrays):
    """A D4RL-style file written with plain h5py (not with the code under test)."""
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=np.asarray(v))
    return path


def _toy_arrays(obs_dim=11, act_dim=3):
    """8 steps: an episode ending in a termination at step 2, one cut by the time limit at step
    4, and an unfinished fragment (steps 5-7) that loaders must drop."""
    n = 8
    obs = np.arange(n * obs_dim, dtype=np.float64).reshape(n, obs_dim) / 10.0
    return {
        "observations": obs,
        "actions": np.tile(np.linspace(-1, 1, act_dim), (n, 1)) * np.arange(n)[:, None] / n,
        "rewards": np.arange(1, n + 1, dtype=np.float64),
        "terminals": np.array([0, 0, 1, 0, 0, 0, 0, 0], dtype=bool),
        "timeouts": np.array([0, 0, 0, 0, 1, 0, 0, 0], dtype=bool),
        "next_observations": obs + 0.05,
    }


@pytest.fixture
def collected_minari():
    """collected_minari(dataset_id, sim="Hopper-v4", seeds=range(6)) -> Trajectories-ready id: a real local Minari
    dataset of real simulator episodes, made as ``python -m envs.collect`` makes one (its rollout and writer),
    under the test's Minari root (``data_dirs``), with a noisy zero policy."""
    from envs.collect import rollout_episodes
    from envs.minari_source import write_minari
    from envs.vector import make_sim

    def make(dataset_id, sim="Hopper-v4", seeds=range(6)):
        act_dim = make_sim(sim).action_space.shape[0]
        policy = lambda obs, eps: np.zeros((len(obs), act_dim)) + (0.3 * eps if eps is not None else 0.0)  # noqa: E731
        eps = rollout_episodes(policy, lambda: make_sim(sim), seeds=list(seeds), act_dim=act_dim)
        write_minari(dataset_id, eps, sim, metadata={"collector": "tests"})
        return dataset_id

    return make
