"""D4RL HDF5 files: splitting, returns-to-go and every bad file we promise a clear error for.
All files are real HDF5 written with h5py here."""

import os

import h5py
import numpy as np
import pytest

from envs import DatasetError, Trajectories, load_dataset
from envs.d4rl import read_d4rl, trajectories_to_arrays, write_d4rl
from envs.errors import DatasetNotFound


def test_split_on_terminals_and_timeouts_drops_fragment(tmp_path, write_h5, toy):
    ds = read_d4rl(write_h5(tmp_path / "f.hdf5", **toy), "hopper-medium", "Hopper-v4")
    assert len(ds) == 2 and ds.num_steps == 5  # steps 5-7 are the unfinished fragment
    assert ds.lengths.tolist() == [3, 2] and ds.starts.tolist() == [0, 3]
    assert ds.terminal.tolist() == [True, False]  # terminated, then cut by the time limit
    assert ds.rewards.tolist() == [1, 2, 3, 4, 5]
    assert ds.rtg.tolist() == [6, 5, 3, 9, 5]  # 1+2+3, 2+3, 3 | 4+5, 5
    assert ds.returns.tolist() == [6, 9]
    assert ds.timesteps.tolist() == [0, 1, 2, 0, 1]
    assert ds.step_end.tolist() == [3, 3, 3, 5, 5]
    for k in ("observations", "actions", "rewards"):
        assert getattr(ds, k).dtype == np.float32
    ep0, ep1 = ds.episodes
    assert ep0["dones"].tolist() == [False, False, True] and ep0["terminal"] is True
    assert ep1["dones"].tolist() == [False, False] and ep1["terminal"] is False
    np.testing.assert_array_equal(ep1["observations"], toy["observations"][3:5].astype(np.float32))
    obs = toy["observations"][:5]
    np.testing.assert_allclose(ds.state_mean, obs.mean(0), rtol=1e-6)
    np.testing.assert_allclose(ds.state_std, obs.std(0) + 1e-6, rtol=1e-6)


def test_missing_timeouts_falls_back_to_episode_limit(tmp_path, write_h5, toy):
    toy = {k: v for k, v in toy.items() if k != "timeouts"}
    with pytest.warns(UserWarning, match="no 'timeouts'"):
        ds = read_d4rl(write_h5(tmp_path / "v0.hdf5", **toy), max_episode_steps=2)
    # terminal at 2 -> [0,1] cut by limit, [2] terminal; then [3,4], [5,6] cut, 7 dropped
    assert ds.lengths.tolist() == [2, 1, 2, 2] and ds.terminal.tolist() == [False, True, False, False]


def test_write_then_read_round_trip_is_atomic(tmp_path, write_h5, toy):
    ds = read_d4rl(write_h5(tmp_path / "src.hdf5", **toy))
    out = write_d4rl(tmp_path / "out" / "x.hdf5", trajectories_to_arrays(ds), {"policy_step": 7})
    assert sorted(os.listdir(out.parent)) == ["x.hdf5"]  # no temporary left behind
    back = read_d4rl(out)
    for k in ("observations", "actions", "rewards", "lengths", "terminal"):
        np.testing.assert_array_equal(getattr(back, k), getattr(ds, k))
    assert back.metadata == {"policy_step": 7}
    with h5py.File(out) as f:
        assert f["observations"].dtype == np.float32 and f["observations"].compression == "gzip"


def test_failed_write_keeps_the_old_file(tmp_path, write_h5, toy):
    good = write_d4rl(tmp_path / "w" / "x.hdf5", {k: toy[k] for k in toy})
    before = good.read_bytes()
    bad = dict(toy, observations=np.array([["a"]] * 8))  # cannot become float32
    with pytest.raises(ValueError):
        write_d4rl(good, bad)
    assert good.read_bytes() == before and sorted(os.listdir(good.parent)) == ["x.hdf5"]


# --- bad input --------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    with pytest.raises(DatasetNotFound, match="no D4RL file"):
        read_d4rl(tmp_path / "nope.hdf5")
    with pytest.raises(DatasetError, match="no file at"):
        load_dataset("hopper-medium", source=f"d4rl:{tmp_path / 'nope.hdf5'}", verbose=False)


def test_truncated_file(tmp_path, write_h5, toy):
    big = dict(toy, observations=np.random.default_rng(0).standard_normal((8, 11)))
    path = write_h5(tmp_path / "t.hdf5", **big)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(DatasetError, match="truncated"):
        read_d4rl(path)


def test_corrupt_file(tmp_path):
    path = tmp_path / "c.hdf5"
    path.write_bytes(b"<html>404 not found</html>" * 10)
    with pytest.raises(DatasetError, match="not a readable HDF5 file"):
        read_d4rl(path)


def test_missing_keys(tmp_path, write_h5, toy):
    path = write_h5(tmp_path / "k.hdf5", **{k: v for k, v in toy.items() if k != "rewards"})
    with pytest.raises(DatasetError, match=r"missing key\(s\) \['rewards'\]"):
        read_d4rl(path)


def test_arrays_of_unequal_length(tmp_path, write_h5, toy):
    path = write_h5(tmp_path / "u.hdf5", **dict(toy, actions=toy["actions"][:5]))
    with pytest.raises(DatasetError, match="differ in length"):
        read_d4rl(path)


@pytest.mark.parametrize("key,value", [("observations", np.nan), ("rewards", np.inf), ("actions", -np.inf)])
def test_nan_and_inf(tmp_path, write_h5, toy, key, value):
    arr = toy[key].copy()
    arr[1] = value
    path = write_h5(tmp_path / "n.hdf5", **dict(toy, **{key: arr}))
    with pytest.raises(DatasetError, match=f"{key} holds .* NaN/inf"):
        read_d4rl(path)


def test_dims_that_do_not_match_the_simulator(data_dirs, write_h5, toy):
    # a walker2d-shaped file (obs 17, act 6) saved under the hopper-medium name
    walker = dict(toy, observations=np.zeros((8, 17)), actions=np.zeros((8, 6)))
    write_h5(data_dirs["d4rl"] / "hopper_medium-v2.hdf5", **walker)
    with pytest.raises(DatasetError, match="observations have 17 dims and actions 6, but Hopper-v4"):
        load_dataset("hopper-medium", verbose=False)
    # actions alone wrong
    write_h5(data_dirs["d4rl"] / "hopper_medium-v2.hdf5", **dict(toy, actions=np.zeros((8, 2))))
    with pytest.raises(DatasetError, match="actions 2"):
        load_dataset("hopper-medium", verbose=False)


def test_empty_dataset(tmp_path, write_h5):
    path = write_h5(tmp_path / "e.hdf5", observations=np.zeros((0, 11)), actions=np.zeros((0, 3)),
                    rewards=np.zeros(0), terminals=np.zeros(0, bool), timeouts=np.zeros(0, bool))
    with pytest.raises(DatasetError, match="empty"):
        read_d4rl(path)


def test_all_terminal(tmp_path, write_h5, toy):
    path = write_h5(tmp_path / "a.hdf5", **dict(toy, terminals=np.ones(8, bool)))
    with pytest.raises(DatasetError, match="every one of the 8 steps is marked terminal"):
        read_d4rl(path)


def test_no_episode_end_at_all(tmp_path, write_h5, toy):
    path = write_h5(tmp_path / "z.hdf5", **dict(toy, terminals=np.zeros(8, bool), timeouts=np.zeros(8, bool)))
    with pytest.raises(DatasetError, match="no complete episode"):
        read_d4rl(path)


def test_trajectories_reject_bad_tiling():
    with pytest.raises(DatasetError, match="do not tile"):
        Trajectories(observations=np.zeros((4, 11)), actions=np.zeros((4, 3)), rewards=np.zeros(4),
                     starts=[0, 3], lengths=[2, 2], terminal=[True, True])
