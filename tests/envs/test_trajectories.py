"""envs.trajectories: the dataset fingerprint (what a checkpoint records of its data) and clipping,
on real files written as D4RL HDF5 and as a real Minari dataset."""

import numpy as np

from envs import Trajectories, load_dataset
from envs.d4rl import write_d4rl
from envs.minari_source import write_minari


def episodes(seed=0, n_eps=3, n=6):
    rng = np.random.default_rng(seed)
    return [{"observations": rng.standard_normal((n + 1, 11)).astype(np.float32),
             "actions": rng.uniform(-1, 1, (n, 3)).astype(np.float32), "rewards": rng.uniform(0, 3, n).astype(np.float32),
             "terminations": np.arange(n) == n - 1, "truncations": np.zeros(n, bool)} for _ in range(n_eps)]


def as_d4rl(eps):
    arrays = {k: np.concatenate([e[k] for e in eps]) for k in ("actions", "rewards")}
    arrays["observations"] = np.concatenate([e["observations"][:-1] for e in eps])
    arrays["terminals"] = np.concatenate([e["terminations"] for e in eps])
    arrays["timeouts"] = np.concatenate([e["truncations"] for e in eps])
    return arrays


def test_the_fingerprint_is_the_content_whatever_the_format(data_dirs):
    eps = episodes()
    a = load_dataset("hopper-medium", source=f"d4rl:{write_d4rl(data_dirs['d4rl'] / 'a.hdf5', as_d4rl(eps))}",
                     verbose=False)
    write_minari("primal-dt/hopper/medium-v0", eps, "Hopper-v4")
    b = load_dataset("hopper-medium", source="minari:primal-dt/hopper/medium-v0", verbose=False)
    assert a.source != b.source and a.fingerprint == b.fingerprint
    assert a.fingerprint.startswith("sha256:") and len(a.fingerprint) == 7 + 64


def test_one_changed_value_or_boundary_changes_the_fingerprint():
    eps = [{"observations": e["observations"][:-1], "actions": e["actions"], "rewards": e["rewards"],
            "terminal": True} for e in episodes()]
    base = Trajectories.from_episodes(eps).fingerprint
    nudged = [dict(e) for e in eps]
    nudged[1] = dict(nudged[1], rewards=nudged[1]["rewards"] + np.float32(1e-3))
    assert Trajectories.from_episodes(nudged).fingerprint != base
    cut = Trajectories.from_episodes(eps)
    other = Trajectories(cut.observations, cut.actions, cut.rewards, starts=[0, 5, 12], lengths=[5, 7, 6],
                         terminal=cut.terminal)  # the same steps, other episodes
    assert other.fingerprint != base
    assert Trajectories.from_episodes(eps).fingerprint == base


def test_clipping_counts_what_moved_and_changes_the_fingerprint():
    eps = [{"observations": e["observations"][:-1], "actions": 2 * e["actions"], "rewards": e["rewards"],
            "terminal": True} for e in episodes()]
    ds = Trajectories.from_episodes(eps)
    before, outside = ds.fingerprint, int((abs(ds.actions) > 1).sum())
    assert ds.clip_actions(-1.0, 1.0) == outside > 0
    assert float(abs(ds.actions).max()) == 1.0 and ds.fingerprint != before
    assert ds.episodes[0]["actions"].max() <= 1.0  # the per-episode views see the clipped values
    assert ds.clip_actions(-1.0, 1.0) == 0
