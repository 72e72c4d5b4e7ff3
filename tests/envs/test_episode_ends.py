"""Episode boundaries cannot vanish silently, and a file cannot make the loader allocate what it merely
declares: real HDF5 files and real Minari datasets made here, with their flags zeroed or sizes forged."""

import json

import h5py
import numpy as np
import pytest

from envs import DatasetError, load_dataset
from envs.d4rl import read_d4rl
from envs.minari_source import minari_root, write_minari


def _episodes(lengths, ends, obs_dim=11, act_dim=3, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n, end in zip(lengths, ends):
        term, trunc = np.zeros(n, bool), np.zeros(n, bool)
        term[-1], trunc[-1] = end == "term", end == "trunc"
        out.append({"observations": rng.standard_normal((n + 1, obs_dim)), "actions": rng.uniform(-1, 1, (n, act_dim)),
                    "rewards": np.ones(n), "terminations": term, "truncations": trunc})
    return out


def test_minari_episodes_whose_end_flags_were_zeroed_are_an_error(data_dirs):
    """30 episodes, every end flag zeroed but the last episode's: not "1 episodes" trained on, an error."""
    write_minari("mujoco/hopper/medium-v0", _episodes([2] * 29 + [60], ["open"] * 29 + ["term"]), "Hopper-v5")
    with pytest.raises(DatasetError, match=r"Minari dataset mujoco/hopper/medium-v0 at .*: 29 of its 30 episodes "
                                           r"\(ids 0, 1, 2, 3, 4, \.\.\.\) end with neither a termination nor a "
                                           "truncation; only the last may be unfinished"):
        load_dataset("hopper-medium", source="minari", verbose=False)
    # an unfinished last episode (a collection stopped mid-episode) is dropped as before
    write_minari("mujoco/hopper/medium-v0", _episodes([3, 2, 4], ["term", "trunc", "open"]), "Hopper-v5", overwrite=True)
    assert load_dataset("hopper-medium", source="minari", verbose=False).lengths.tolist() == [3, 2]


def test_minari_metadata_counting_other_episodes_than_stored_is_an_error(data_dirs):
    write_minari("mujoco/hopper/medium-v0", _episodes([3, 2, 4], ["term", "trunc", "term"]), "Hopper-v5")
    meta_path = minari_root() / "mujoco/hopper/medium-v0" / "data" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "total_episodes": 1}))  # minari would read only the first
    with pytest.raises(DatasetError, match="its metadata counts 1 episodes but main_data.hdf5 holds 3 episode groups"):
        load_dataset("hopper-medium", source="minari", verbose=False)


def test_minari_episode_longer_than_the_simulators_limit_is_an_error(data_dirs):
    write_minari("mujoco/hopper/medium-v0", _episodes([3, 1001], ["term", "trunc"]), "Hopper-v5")
    with pytest.raises(DatasetError, match="episode 1 is 1001 steps long, more than Hopper-v5's limit of 1000 steps"):
        load_dataset("hopper-medium", source="minari", verbose=False)


def test_d4rl_file_without_timeouts_or_terminals_of_a_falling_robot_is_an_error(tmp_path, write_hopper_file):
    """Real Hopper-v4 episodes (most fall) with the terminals zeroed and no timeouts key: cutting every 1000
    steps would train on pseudo-episodes holding several real ones."""
    path = write_hopper_file(tmp_path / "hopper-v2.hdf5")
    with h5py.File(path, "a") as f:
        assert f["terminals"][()].any()
        del f["timeouts"]
        f["terminals"][...] = False
    with pytest.raises(DatasetError, match=r"hopper-v2.hdf5: records no episode end at all \(no 'timeouts' key, and "
                                           r"none of its .* terminals is set\), but Hopper-v4's episodes end when"):
        read_d4rl(path, "hopper-medium", "Hopper-v4")


def test_d4rl_file_without_timeouts_is_cut_at_the_limit_and_says_so(tmp_path, write_h5, capsys):
    """HalfCheetah never terminates: its episodes are the time limit's, which the file may leave implicit."""
    n, rng = 2500, np.random.default_rng(0)
    path = write_h5(tmp_path / "cheetah-v0.hdf5", observations=rng.standard_normal((n, 17)),
                    actions=rng.uniform(-1, 1, (n, 6)), rewards=np.ones(n), terminals=np.zeros(n, bool))
    ds = read_d4rl(path, "halfcheetah-medium", "HalfCheetah-v4", 1000)
    assert ds.lengths.tolist() == [1000, 1000] and not ds.terminal.any()
    assert capsys.readouterr().err.splitlines() == [
        f"[envs] note: {path} has no 'timeouts' key: episodes end at a terminal or after 1000 steps (the simulator's "
        "limit), 2 of them so"]


def test_d4rl_file_declaring_absurd_sizes_is_refused_before_reading(tmp_path, write_h5, toy):
    path = write_h5(tmp_path / "huge.hdf5", **{k: v for k, v in toy.items() if k != "observations"})
    with h5py.File(path, "a") as f:  # declared, never written: HDF5 allocates nothing for it
        f.create_dataset("observations", shape=(10**11, 11), dtype="f4", chunks=(1024, 11))
    with pytest.raises(DatasetError, match=r"huge.hdf5: dataset 'observations' declares shape \(100000000000, 11\)"):
        read_d4rl(path)
    with h5py.File(path, "a") as f:  # within the bound, but far more than the file could hold
        del f["observations"]
        f.create_dataset("observations", shape=(10**8, 11), dtype="f4", chunks=(1024, 11))
    with pytest.raises(DatasetError, match=r"huge.hdf5: its datasets declare 4.4e\+09 bytes, but the file holds"):
        read_d4rl(path)


def test_minari_file_declaring_absurd_sizes_is_refused_before_minari_reads_it(data_dirs):
    write_minari("mujoco/hopper/medium-v0", _episodes([3, 2], ["term", "trunc"]), "Hopper-v5")
    with h5py.File(minari_root() / "mujoco/hopper/medium-v0" / "data" / "main_data.hdf5", "a") as f:
        del f["episode_0/rewards"]
        f.create_dataset("episode_0/rewards", shape=(10**11,), dtype="f8", chunks=(4096,))
    with pytest.raises(DatasetError, match=r"main_data.hdf5: dataset 'episode_0/rewards' declares shape "
                                           r"\(100000000000,\)"):
        load_dataset("hopper-medium", source="minari", verbose=False)
