"""envs.trajectories: the dataset fingerprint (what a checkpoint records of its data) and clipping,
on real files written as D4RL HDF5 and as a real Minari dataset."""

import numpy as np
import pytest

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


def random_dataset(n_eps=30, seed=0):
    rng = np.random.default_rng(seed)
    return Trajectories.from_episodes([{"observations": rng.standard_normal((n, 11)).astype(np.float32) + e,
                                        "actions": rng.uniform(-1, 1, (n, 3)), "rewards": rng.uniform(0, 3, n),
                                        "terminal": bool(e % 2)}
                                       for e, n in enumerate(rng.integers(1, 40, n_eps))], source="test data")


def test_the_held_out_split_is_seeded_disjoint_and_covers_every_episode():
    ds = random_dataset()
    train, held = ds.hold_out(0.2, seed=3)
    assert len(held) == 6 and len(train) == 24 and (np.diff(held) > 0).all() and (np.diff(train) > 0).all()
    assert sorted([*train, *held]) == list(range(30))
    again, held_again = ds.hold_out(0.2, seed=3)
    assert np.array_equal(held, held_again) and np.array_equal(train, again)
    others = {tuple(ds.hold_out(0.2, seed=s)[1]) for s in range(4, 10)}
    assert len(others | {tuple(held)}) > 1  # other seeds, other splits
    assert len(ds.hold_out(0.001, seed=0)[1]) == 1  # a share below one episode still holds one out
    assert len(ds.hold_out(0.0, seed=0)[1]) == 0 and len(ds.hold_out(0.0, seed=0)[0]) == 30


def test_a_dataset_that_cannot_spare_an_episode_says_so():
    import pytest

    from envs import DatasetError

    with pytest.raises(DatasetError, match="test data: holding out 1 of its 1 episode.*leaves none to train on"):
        random_dataset(n_eps=1).hold_out(0.05, seed=0)
    with pytest.raises(DatasetError, match="holding out 30 of its 30"):
        random_dataset().hold_out(0.99, seed=0)


def test_a_subset_is_the_dataset_of_those_episodes_with_their_own_statistics():
    ds = random_dataset()
    picked = [7, 2, 19]
    sub = ds.subset(picked)
    direct = Trajectories.from_episodes([ds.episodes[e] for e in picked])  # built from the episodes alone
    for name in ("observations", "actions", "rewards", "starts", "lengths", "terminal", "rtg", "timesteps",
                 "step_end", "state_mean", "state_std"):
        np.testing.assert_array_equal(getattr(sub, name), getattr(direct, name), err_msg=name)
    obs = np.concatenate([ds.episodes[e]["observations"] for e in picked]).astype(np.float64)
    np.testing.assert_allclose(sub.state_mean, obs.mean(0), rtol=1e-5)  # not the whole dataset's
    assert not np.allclose(sub.state_mean, ds.state_mean, atol=1e-3)
    assert sub.source == ds.source and sub.fingerprint == direct.fingerprint != ds.fingerprint


def test_rewards_beyond_any_simulator_are_a_data_error_not_a_divergence():
    """Rewards of 1e30 (a corrupt file) are refused when the data is built, naming the rewards, rather than
    overflowing the returns-to-go on the first training step and being diagnosed as a learning rate."""
    from envs.sources import DatasetError
    from envs.trajectories import Trajectories

    n = 20
    ep = {"observations": np.zeros((n, 3), np.float32), "actions": np.zeros((n, 2), np.float32),
          "rewards": np.full(n, 1e30, np.float32), "terminal": True}
    with pytest.raises(DatasetError, match=r"rewards holds 20 value\(s\) larger than 1e\+06 in size .*corrupt"):
        Trajectories.from_episodes([ep], name="x", source="test")
    Trajectories.from_episodes([{**ep, "rewards": np.full(n, 3.0, np.float32)}], name="x", source="test")
