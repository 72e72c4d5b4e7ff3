"""Shared test setup: one thread per test process (the CI machine has 2 cores) and fixed seeds;
small Decision-Transformer models and checkpoint files for the agent and evaluator tests."""

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# -- real simulator data: trainer and evaluator tests run on it through the real loader ---------------
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


def _write_hopper(path, seed: int = 0):
    with h5py.File(path, "w") as f:
        for k, v in hopper_rollouts(seed=seed).items():
            f.create_dataset(k, data=v.astype(bool if k in ("terminals", "timeouts") else np.float32))
    return path


@pytest.fixture(scope="session")
def write_hopper_file():
    """``write(path, seed=0) -> path``: a D4RL-format file of real Hopper-v4 episodes (other seeds,
    other episodes and statistics)."""
    return _write_hopper


@pytest.fixture(scope="session")
def hopper_file(tmp_path_factory):
    """A small D4RL-format HDF5 file of real Hopper-v4 rollouts (``data_source=d4rl:PATH``)."""
    return _write_hopper(tmp_path_factory.mktemp("data") / "hopper_rollouts-v2.hdf5")


# -- Decision-Transformer models and checkpoints shared by tests/agents and tests/eval ---------------
# Factories, so one test can build several; session-scoped because they are pure functions (module
# fixtures such as a rollout test's checkpoint use them too). Checkpoints are real files written by
# agents.dt_checkpoint.save, the one writer the trainer uses.
ENV = "hopper-medium"


@pytest.fixture(scope="session")
def hopper_stats():
    """(state_mean, state_std) [11] float32: normalisation statistics that are not the identity, so a
    test notices when an agent forgets them."""
    import numpy as np

    obs_dim = _spec().obs_dim
    rng = np.random.default_rng(0)
    return rng.normal(0, 0.3, obs_dim).astype(np.float32), rng.uniform(0.5, 2.0, obs_dim).astype(np.float32)


@pytest.fixture(scope="session")
def tiny_dt():
    """tiny_dt(layout="primal+dt", K=5, options=None, layers=(), seed=0, d_model=32, n_heads=2,
    n_layers=3): a small DecisionTransformer for hopper (eval mode, no dropout, seeded weights)."""
    from agents import DecisionTransformer, DTConfig

    def make(layout="primal+dt", K=5, options=None, layers=(), seed=0, d_model=32, n_heads=2, n_layers=3):
        spec = _spec()
        torch.manual_seed(seed)
        cfg = DTConfig(spec.obs_dim, spec.act_dim, K=K, d_model=d_model, n_heads=n_heads, n_layers=n_layers,
                       layout=layout, layers=tuple(layers),
                       options=options if options is not None else {"primal": {"s": 8}}, dropout=0.0)
        return DecisionTransformer(cfg).eval()

    return make


@pytest.fixture(scope="session")
def dt_checkpoint(hopper_stats):
    """dt_checkpoint(model, targets=(3600, 1800), reward_scale=1000, env="hopper-medium", source="test",
    training=None) -> agents.dt_checkpoint.DTCheckpoint holding ``model`` and hopper_stats."""
    from agents.dt_checkpoint import DataInfo, DTCheckpoint

    def make(model, targets=(3600.0, 1800.0), reward_scale=1000.0, env=ENV, source="test", training=None):
        mean, std = hopper_stats
        data = DataInfo(env=env, state_mean=mean, state_std=std, reward_scale=reward_scale, targets=targets,
                        gym_id=_spec().gym_id, source=source)
        return DTCheckpoint(model_config=model.cfg, model=model.state_dict(), data=data,
                            config={"env": env, "K": model.cfg.K}, training=training)

    return make


@pytest.fixture(scope="session")
def dt_checkpoint_file(dt_checkpoint):
    """dt_checkpoint_file(directory, model, **dt_checkpoint options) -> directory/last.pt, written
    by agents.dt_checkpoint.save (a run directory as primal_dt.train leaves it)."""
    from agents import dt_checkpoint as schema

    def write(directory, model, **kw):
        return schema.save(dt_checkpoint(model, **kw), Path(directory) / schema.FILENAME)

    return write


@pytest.fixture(scope="session")
def foreign_checkpoint_file():
    """foreign_checkpoint_file(directory) -> a real primal-dt checkpoint of another kind (a
    classifier's), which every DT reader must refuse by name."""
    from primal_dt import checkpoint

    def write(directory):
        return checkpoint.save_atomic({"kind": "classifier", "config": {}, "model": {}},
                                      Path(directory) / "classifier.pt")

    return write


def _spec():
    import envs

    return envs.get_spec(ENV)
