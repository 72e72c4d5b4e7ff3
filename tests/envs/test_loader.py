"""Source resolution order: D4RL file > local Minari > download > replica, with the source
printed and returned, and broken data stopping the search instead of being skipped."""

import warnings

import numpy as np
import pytest

from envs import DatasetError, ReplicaWarning, load_dataset
from envs.d4rl import write_d4rl
from envs.sources import DatasetNotFound
from envs.minari_source import write_minari


def _minari_eps(n_eps=2, n=4):
    rng = np.random.default_rng(0)
    return [{"observations": rng.standard_normal((n + 1, 11)), "actions": rng.uniform(-1, 1, (n, 3)),
             "rewards": np.ones(n), "terminations": np.arange(n) == n - 1, "truncations": np.zeros(n, bool)}
            for _ in range(n_eps)]


def test_order_d4rl_then_minari_then_replica(data_dirs, write_h5, toy, capsys):
    write_h5(data_dirs["replicas"] / "hopper_medium-replica.hdf5", **toy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicaWarning)  # a command's console says it once, as one line
        ds = load_dataset("hopper-medium")
    said = [ln for ln in capsys.readouterr().err.splitlines() if "REPLICA" in ln]
    assert ds.source.startswith("replica:") and len(said) == 1 and said[0].startswith("!! WARNING: hopper-medium")
    with pytest.warns(ReplicaWarning, match="NOT the published") as caught:  # a library caller: a Python warning,
        load_dataset("hopper-medium", verbose=False)
    assert caught[0].filename == __file__  # pointing at the caller's line

    write_minari("mujoco/hopper/medium-v0", _minari_eps(), "Hopper-v5")
    ds = load_dataset("hopper-medium")
    assert ds.source == "minari:mujoco/hopper/medium-v0" and ds.gym_id == "Hopper-v5"
    assert len(ds) == 2 and any("d4rl: no" in n for n in ds.metadata["searched"])

    write_h5(data_dirs["d4rl"] / "hopper_medium-v2.hdf5", **toy)
    ds = load_dataset("hopper-medium")
    out = capsys.readouterr().out
    assert ds.source == f"d4rl:{data_dirs['d4rl'] / 'hopper_medium-v2.hdf5'}" and ds.gym_id == "Hopper-v4"
    assert f"source {ds.source}" in out and ds.name == "hopper-medium"
    # each source can also be asked for by name
    assert load_dataset("hopper-medium", source="minari", verbose=False).source.startswith("minari:")
    with pytest.warns(ReplicaWarning):
        assert load_dataset("hopper-medium", source="replica", verbose=False).source.startswith("replica:")


def test_broken_d4rl_file_stops_the_search(data_dirs, write_h5, toy):
    write_h5(data_dirs["replicas"] / "hopper_medium-replica.hdf5", **toy)
    (data_dirs["d4rl"] / "hopper_medium-v2.hdf5").write_bytes(b"\0" * 100)
    with pytest.raises(DatasetError, match="hopper_medium-v2.hdf5 is not a readable HDF5"):
        load_dataset("hopper-medium", verbose=False)


def test_medium_expert_from_separate_d4rl_files(data_dirs, write_h5, toy):
    write_h5(data_dirs["d4rl"] / "hopper_medium-v2.hdf5", **toy)
    write_h5(data_dirs["d4rl"] / "hopper_expert-v2.hdf5", **dict(toy, rewards=toy["rewards"] * 10))
    ds = load_dataset("hopper-medium-expert", verbose=False)
    assert ds.lengths.tolist() == [3, 2, 3, 2] and ds.returns.tolist() == [6, 9, 60, 90]
    assert "hopper_medium-v2.hdf5+" in ds.source
    # a real medium-expert file wins over the pair
    write_h5(data_dirs["d4rl"] / "hopper_medium_expert-v2.hdf5", **toy)
    assert load_dataset("hopper-medium-expert", verbose=False).source.endswith("hopper_medium_expert-v2.hdf5")


def test_bundled_replica_is_the_last_resort(data_dirs, write_h5, toy):
    write_h5(data_dirs["bundled"] / "hopper_medium-replica.hdf5", **toy)
    with pytest.warns(ReplicaWarning):
        ds = load_dataset("hopper-medium", verbose=False)
    assert ds.source == f"replica:{data_dirs['bundled'] / 'hopper_medium-replica.hdf5'}"
    # a locally generated replica is preferred to the bundled one
    write_d4rl(data_dirs["replicas"] / "hopper_medium-replica.hdf5", toy, {"policy_step": 5})
    with pytest.warns(ReplicaWarning, match="policy step 5"):
        assert load_dataset("hopper-medium", verbose=False).source.startswith(f"replica:{data_dirs['replicas']}")


def test_nothing_anywhere_says_where_it_looked_and_what_to_do(data_dirs):
    with pytest.raises(DatasetNotFound) as e:
        load_dataset("walker2d-medium-replay", verbose=False)
    msg = str(e.value)
    assert "walker2d_medium_replay-v2.hdf5" in msg and str(data_dirs["d4rl"]) in msg
    assert "python -m envs.collect env=walker2d level=medium-replay" in msg


def test_bad_source_and_name(data_dirs):
    with pytest.raises(ValueError, match="data source 'web' is not one of auto, d4rl, minari, replica"):
        load_dataset("hopper-medium", source="web")
    with pytest.raises(KeyError, match="Did you mean"):
        load_dataset("hopper-meduim")


def test_replica_records_its_simulator_version(data_dirs, toy):
    write_d4rl(data_dirs["replicas"] / "hopper_medium-replica.hdf5", toy, {"gym_id": "Hopper-v5"})
    with pytest.warns(ReplicaWarning):
        assert load_dataset("hopper-medium", verbose=False).gym_id == "Hopper-v5"


def test_actions_outside_the_simulators_box_are_refused_from_every_source(data_dirs, write_h5, toy):
    """Whatever the source (D4RL file, Minari dataset), actions outside [-1, 1] stop the load with how
    many values lie outside and their range; clip_actions=True clips them and says so."""
    write_h5(data_dirs["d4rl"] / "hopper_medium-v2.hdf5", **dict(toy, actions=toy["actions"] * 5))
    with pytest.raises(DatasetError, match=r"hopper_medium-v2.hdf5: 6 of 15 action values \(3 of 5 steps\) lie outside "
                                         r"Hopper-v4's action space \[-1, 1\]; they range over \[-2.5, 2.5\].*"
                                         r"data_clip_actions=true"):
        load_dataset("hopper-medium", verbose=False)
    eps = _minari_eps()
    eps[1]["actions"][2, 0] = -1.5
    write_minari("mujoco/hopper/medium-v0", eps, "Hopper-v5")
    with pytest.raises(DatasetError, match=r"minari:mujoco/hopper/medium-v0: 1 of 24 action values \(1 of 8 steps\) "
                                         r"lie outside Hopper-v5's action space \[-1, 1\]; they range over \[-1.5, -1.5\]"):
        load_dataset("hopper-medium", source="minari", verbose=False)


def test_clipping_is_an_explicit_choice_and_is_recorded(data_dirs, write_h5, toy, capsys):
    write_h5(data_dirs["d4rl"] / "hopper_medium-v2.hdf5", **dict(toy, actions=toy["actions"] * 5))
    ds = load_dataset("hopper-medium", clip_actions=True)
    assert float(abs(ds.actions).max()) == 1.0 and ds.metadata["clipped_actions"] == 6
    err = capsys.readouterr().err
    assert "6 of 15 action values" in err and "clipped into the box as asked" in err
    inside = load_dataset("hopper-medium", source=f"d4rl:{write_h5(data_dirs['d4rl'] / 'ok.hdf5', **toy)}",
                          clip_actions=True, verbose=False)
    assert "clipped_actions" not in inside.metadata  # nothing to clip, nothing said
