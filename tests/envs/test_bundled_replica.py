"""The replica shipped inside the package: present, readable offline, and described truthfully
by its own provenance (what the README quotes)."""

from pathlib import Path

import numpy as np

import envs
from envs.d4rl import read_d4rl

BUNDLED = Path(envs.__file__).parent / "replicas" / "hopper_medium-replica.hdf5"


def test_bundled_hopper_medium_replica():
    assert BUNDLED.exists(), f"{BUNDLED} is missing: regenerate it with envs.collect (see README)"
    assert BUNDLED.stat().st_size < 10e6
    ds = read_d4rl(BUNDLED, "hopper-medium", "Hopper-v4")
    prov = ds.metadata
    assert ds.gym_id == "Hopper-v4" and prov["collector"] == "envs.collect" and prov["name"] == "hopper-medium"
    assert prov["steps"] == ds.num_steps and prov["episodes"] == len(ds)
    assert 100_000 <= ds.num_steps <= 200_000
    assert np.isclose(prov["dataset_return_mean"], ds.returns.mean(), rtol=1e-3)
    assert {"policy_step", "policy_return", "train_seed", "ref_min_score", "ref_max_score"} <= set(prov)
