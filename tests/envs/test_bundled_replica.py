"""The replicas shipped inside the package: present, readable offline, and described truthfully
by their own provenance (what docs/data.md quotes)."""

from pathlib import Path

import numpy as np
import pytest

import envs
from envs import load_dataset, normalized_score
from envs.d4rl import read_d4rl
from envs.replica import ReplicaWarning

BUNDLED = Path(envs.__file__).parent / "replicas" / "hopper_medium-replica.hdf5"
BUNDLED_REPLAY = BUNDLED.with_name("hopper_medium_replay-replica.hdf5")


def test_bundled_hopper_medium_replica():
    assert BUNDLED.exists(), f"{BUNDLED} is missing: regenerate it with envs.collect (see docs/data.md)"
    assert BUNDLED.stat().st_size < 10e6
    ds = read_d4rl(BUNDLED, "hopper-medium", "Hopper-v4")
    prov = ds.metadata
    assert ds.gym_id == "Hopper-v4" and prov["collector"] == "envs.collect" and prov["name"] == "hopper-medium"
    assert prov["steps"] == ds.num_steps and prov["episodes"] == len(ds)
    assert 100_000 <= ds.num_steps <= 200_000
    assert np.isclose(prov["dataset_return_mean"], ds.returns.mean(), rtol=1e-3)
    assert {"policy_step", "policy_return", "train_seed", "ref_min_score", "ref_max_score"} <= set(prov)


def test_bundled_hopper_medium_replay_replica():
    """D4RL's medium-replay, from the behaviour run of the medium replica: every transition SAC saw up
    to the medium policy's step (the unfinished last episode aside), in training order, so its returns
    climb from a random policy's to the medium level."""
    assert BUNDLED_REPLAY.exists(), f"{BUNDLED_REPLAY} is missing: regenerate it with envs.collect (see docs/data.md)"
    assert BUNDLED_REPLAY.stat().st_size < 10e6
    ds = read_d4rl(BUNDLED_REPLAY, "hopper-medium-replay", "Hopper-v4")
    prov, medium = ds.metadata, read_d4rl(BUNDLED, "hopper-medium", "Hopper-v4").metadata
    assert prov["collector"] == "envs.collect" and prov["name"] == "hopper-medium-replay" and prov["gym_id"] == "Hopper-v4"
    assert prov["policies"]["replay"]["episode_seeds"] == "SAC training (replay buffer)"
    for key in ("policy_step", "policy_return", "train_seed", "workdir"):  # the medium replica's policy and run
        assert prov[key] == medium[key], key
    assert prov["steps"] == ds.num_steps and prov["episodes"] == len(ds)
    assert prov["policy_step"] - 1000 < ds.num_steps <= prov["policy_step"]  # all but an unfinished episode
    returns = ds.returns
    assert np.isclose(prov["dataset_return_mean"], returns.mean(), rtol=1e-3)
    tenth = len(ds) // 10
    assert normalized_score("hopper-medium-replay", returns[:tenth].mean()) < 10  # a random policy's level first
    assert returns[-tenth:].mean() > 0.5 * prov["policy_return"]  # the medium level by the end
    assert returns.max() > 0.9 * prov["policy_return"]


def test_the_bundled_medium_replay_replica_is_what_training_loads(monkeypatch):
    """With no D4RL file and no Minari source (Minari publishes no medium-replay), ``env=hopper-medium-replay``
    trains on the bundled replica, with the replica warning."""
    import envs.replica as replica

    monkeypatch.setattr(replica, "BUNDLED_DIR", BUNDLED_REPLAY.parent)
    with pytest.warns(ReplicaWarning, match="hopper-medium-replay: using a REPLICA"):
        ds = load_dataset("hopper-medium-replay", verbose=False)
    assert ds.source == f"replica:{BUNDLED_REPLAY}" and ds.num_steps == ds.metadata["steps"]
