"""The source registry (envs.sources): a new source is one reader plus its registration, and is then what
``data_source`` accepts, what the trainer's help lists and what a report names; Minari dataset ids of the
supported simulators, locally made ones included, are names ``env=`` takes."""

import numpy as np
import pytest

from envs import load_dataset, sources
from envs.d4rl import read_d4rl
from envs.trajectories import Trajectories, split_on_ends


@pytest.fixture
def npz_source():
    """A tiny source registered here, in the test: ``npz:PATH``, the flat D4RL arrays in a numpy .npz file."""
    @sources.register("npz", "PATH", "flat D4RL arrays in a numpy .npz file", label="npz")
    def read_npz(req):
        with np.load(req.where, allow_pickle=False) as z:
            starts, lengths, terminal, keep = split_on_ends(z["terminals"], z["timeouts"], req.where)
            return Trajectories(z["observations"][:keep], z["actions"][:keep], z["rewards"][:keep], starts, lengths,
                                terminal, name=req.spec.name, gym_id=req.spec.gym_id, source=f"npz:{req.where}")

    yield "npz"
    sources._REGISTRY.pop("npz", None)


def test_a_source_registered_in_a_test_loads_and_trains(npz_source, hopper_file, tmp_path, tiny_train):
    from agents import dt_checkpoint
    from agents import train_config
    from primal_dt.train import run

    import h5py

    with h5py.File(hopper_file) as f:
        np.savez(tmp_path / "hopper.npz", **{k: f[k][()] for k in ("observations", "actions", "rewards", "terminals",
                                                                       "timeouts")})
    ds = load_dataset("hopper-medium", source=f"npz:{tmp_path / 'hopper.npz'}", verbose=False)
    same = read_d4rl(hopper_file, "hopper-medium", "Hopper-v4")
    assert ds.fingerprint == same.fingerprint and ds.source == f"npz:{tmp_path / 'hopper.npz'}"
    assert "npz[:PATH]: flat D4RL arrays in a numpy .npz file" in sources.help_text()
    assert sources.label(ds.source) == "npz"
    train_config.check(train_config.TrainConfig(data_source=f"npz:{tmp_path / 'hopper.npz'}"))
    args = [*tiny_train.TINY, f"data_source=npz:{tmp_path / 'hopper.npz'}", f"out={tmp_path / 'out'}", "steps=2",
            *tiny_train.QUIET]
    s = run(args)
    ck = dt_checkpoint.load(s["run_dir"])
    assert s["steps"] == 2 and ck.data.source == ds.source and ck.data.fingerprint == ds.fingerprint
    sources._REGISTRY.pop("npz", None)
    with pytest.raises(ValueError, match="data source 'npz:.*' is not one of auto, d4rl, minari, replica"):
        train_config.check(train_config.TrainConfig(data_source=f"npz:{tmp_path / 'hopper.npz'}"))


def test_registering_a_taken_or_reserved_prefix_is_refused():
    for prefix in ("d4rl", "auto", "a:b"):
        with pytest.raises(ValueError, match="registered twice .*reserved"):
            sources.register(prefix, "X", "another")(lambda req: None)


def test_env_takes_a_locally_made_minari_dataset_id(data_dirs, collected_minari, tmp_path, run_cli, tiny_train):
    """``python -m envs.collect`` files its datasets as primal-dt/<family>/<level>-v0: such an id is a name
    (its recorded simulator, Hopper-v4, decides the dimensions) and trains with ``env=``."""
    from envs import get_spec

    dsid = collected_minari("primal-dt/hopper/medium-v0")
    spec = get_spec(dsid)
    assert (spec.gym_id, spec.obs_dim, spec.max_episode_steps) == ("Hopper-v4", 11, 1000)
    p = run_cli("primal_dt.train", f"env={dsid}", *tiny_train.TINY, "steps=2", f"out={tmp_path / 'out'}",
                *tiny_train.QUIET)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"source minari:{dsid}" in p.stdout and "6 episodes" in p.stdout


@pytest.mark.slow
def test_env_of_an_unsupported_simulator_is_one_error_line(data_dirs, collected_minari, tmp_path, run_cli,
                                                           one_line_error):
    dsid = collected_minari("primal-dt/pendulum/medium-v0", sim="InvertedPendulum-v4", seeds=range(2))
    p = run_cli("primal_dt.train", f"env={dsid}", "steps=1", f"out={tmp_path / 'out'}")
    one_line_error(p, f"Minari dataset '{dsid}' was recorded in InvertedPendulum-v4; the supported simulators are "
                      "Hopper-v4, Hopper-v5")
    p = run_cli("primal_dt.train", "env=mujoco/humanoid/medium-v0", "steps=1", f"out={tmp_path / 'out'}")
    one_line_error(p, "'mujoco/humanoid/medium-v0' names no simulator family here")
    assert not (tmp_path / "out").exists()
