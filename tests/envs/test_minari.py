"""Real local Minari datasets made with minari.create_dataset_from_buffers in a tmp root."""

import os
import time

import numpy as np
import pytest

from envs import DatasetError, load_dataset
from envs.download import reachable
from envs.minari_source import minari_root, read_minari, write_minari
from envs.sources import DatasetNotFound


def _episodes(obs_dim=11, act_dim=3, lengths=(3, 2, 4), ends=("term", "trunc", "open"), seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n, end in zip(lengths, ends):
        term, trunc = np.zeros(n, bool), np.zeros(n, bool)
        if end == "term":
            term[-1] = True
        elif end == "trunc":
            trunc[-1] = True
        out.append({"observations": rng.standard_normal((n + 1, obs_dim)), "actions": rng.uniform(-1, 1, (n, act_dim)),
                    "rewards": np.arange(1, n + 1, dtype=float), "terminations": term, "truncations": trunc,
                    "seed": int(rng.integers(1000))})
    return out


def test_local_minari_dataset_loads(data_dirs):
    eps = _episodes()
    write_minari("mujoco/hopper/medium-v0", eps, "Hopper-v5", metadata={"seeds": [1, 2]},
                 ref_min_score=-20.272305, ref_max_score=3234.3)
    ds = load_dataset("hopper-medium", source="minari", verbose=False)
    assert ds.source == "minari:mujoco/hopper/medium-v0" and ds.gym_id == "Hopper-v5"
    assert ds.lengths.tolist() == [3, 2] and ds.terminal.tolist() == [True, False]  # open episode dropped
    # Minari keeps T+1 observations; the dataset keeps the T the actions were taken in
    np.testing.assert_allclose(ds.observations[:3], eps[0]["observations"][:3].astype(np.float32))
    np.testing.assert_allclose(ds.actions[3:5], eps[1]["actions"].astype(np.float32))
    assert ds.rtg.tolist() == [6, 5, 3, 3, 2]
    assert ds.metadata["seeds"] == [1, 2] and ds.metadata["ref_max_score"] == 3234.3
    # nothing temporary left in the root
    assert not [p for p in os.listdir(minari_root()) if p.startswith(".")]


def test_medium_expert_joins_both_minari_datasets(data_dirs):
    write_minari("mujoco/hopper/medium-v0", _episodes(lengths=(3,), ends=("term",)), "Hopper-v5")
    write_minari("mujoco/hopper/expert-v0", _episodes(lengths=(5, 2), ends=("trunc", "term"), seed=1), "Hopper-v5")
    ds = load_dataset("hopper-medium-expert", source="minari", verbose=False)
    assert ds.lengths.tolist() == [3, 5, 2] and ds.source == "minari:mujoco/hopper/medium-v0+mujoco/hopper/expert-v0"


def test_dataset_of_another_environment_is_refused(data_dirs):
    write_minari("mujoco/hopper/medium-v0", _episodes(obs_dim=17, act_dim=6), "Walker2d-v5")
    with pytest.raises(DatasetError, match="recorded in Walker2d-v5, but hopper-medium needs Hopper-v5"):
        load_dataset("hopper-medium", source="minari", verbose=False)
    # the auto order stops there too instead of silently using something else
    with pytest.raises(DatasetError, match="another environment"):
        load_dataset("hopper-medium", verbose=False)


def test_write_refuses_to_clobber_and_keeps_the_original(data_dirs):
    write_minari("primal-dt/hopper/medium-v0", _episodes(), "Hopper-v4")
    with pytest.raises(FileExistsError, match="already exists"):
        write_minari("primal-dt/hopper/medium-v0", _episodes(seed=5), "Hopper-v4")
    before = read_minari("primal-dt/hopper/medium-v0")
    np.testing.assert_allclose(before.observations[:3], _episodes()[0]["observations"][:3].astype(np.float32))
    write_minari("primal-dt/hopper/medium-v0", _episodes(seed=5), "Hopper-v4", overwrite=True)
    after = load_dataset("hopper-medium", source="minari:primal-dt/hopper/medium-v0", verbose=False)
    np.testing.assert_allclose(after.observations[:3], _episodes(seed=5)[0]["observations"][:3].astype(np.float32))
    assert after.gym_id == "Hopper-v4"


def test_minari_with_no_complete_episode(data_dirs):
    write_minari("mujoco/hopper/medium-v0", _episodes(lengths=(3,), ends=("open",)), "Hopper-v5")
    with pytest.raises(DatasetError, match="no complete episode"):
        load_dataset("hopper-medium", source="minari", verbose=False)


def test_no_minari_source_for_medium_replay(data_dirs):
    with pytest.raises(DatasetNotFound, match="publishes no medium-replay"):
        load_dataset("hopper-medium-replay", source="minari", verbose=False)


def test_download_fails_fast_and_clearly_offline(data_dirs, monkeypatch):
    monkeypatch.setenv("PRIMAL_DT_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    t = time.time()
    with pytest.raises(DatasetNotFound) as e:
        load_dataset("hopper-medium", source="minari", verbose=False)
    assert time.time() - t < 30  # not a hang (a generous bound; offline it takes milliseconds)
    msg = str(e.value)
    assert "mujoco/hopper/medium-v0" in msg and ("unreachable" in msg or "huggingface_hub" in msg)
    assert reachable("127.0.0.1", 9, timeout=2.0) is not None


# -- Minari dataset ids as names (env=mujoco/hopper/medium-v0) -------------------------------------------------
def test_minari_id_is_a_name_with_the_v5_simulator_and_the_datasets_reference_scores(data_dirs):
    from envs import get_spec, normalized_score

    write_minari("mujoco/hopper/medium-v0", _episodes(), "Hopper-v5", ref_min_score=-10.0, ref_max_score=3990.0)
    spec = get_spec("mujoco/hopper/medium-v0")
    assert (spec.family, spec.level, spec.gym_id, spec.obs_dim) == ("hopper", "medium", "Hopper-v5", 11)
    assert (spec.ref_min, spec.ref_max) == (-10.0, 3990.0) and "Minari dataset's metadata" in spec.ref_source
    assert normalized_score("mujoco/hopper/medium-v0", 1990.0) == pytest.approx(50.0)
    ds = load_dataset("mujoco/hopper/medium-v0", verbose=False)  # auto: Minari is its only source
    assert ds.source == "minari:mujoco/hopper/medium-v0" and ds.gym_id == "Hopper-v5" and ds.lengths.tolist() == [3, 2]
    # a dataset that records no reference scores: D4RL's, and the spec says so
    write_minari("mujoco/walker2d/expert-v0", _episodes(obs_dim=17, act_dim=6), "Walker2d-v5")
    walker = get_spec("mujoco/walker2d/expert-v0")
    assert (walker.ref_min, walker.ref_max) == (get_spec("walker2d-expert").ref_min, get_spec("walker2d-expert").ref_max)
    assert walker.ref_source.startswith("D4RL's") and "records no ref_min_score" in walker.ref_source
    assert get_spec("hopper-medium").ref_source.startswith("D4RL's")


def test_unknown_or_unavailable_minari_ids_are_clear_errors(data_dirs):
    from envs import get_spec

    with pytest.raises(KeyError, match="Minari dataset 'mujoco/humanoid/medium-v0' names no simulator family here.*"
                                       "supported simulators are Hopper-v4, Hopper-v5"):
        get_spec("mujoco/humanoid/medium-v0")
    assert get_spec("mujoco/hopper/medium-replay-v0").gym_id == "Hopper-v5"  # any remote id of a family here
    with pytest.raises(DatasetNotFound) as e:  # not local, offline: where to put it and how to get it
        load_dataset("mujoco/hopper/expert-v0", verbose=False)
    msg = str(e.value)
    assert "no local mujoco/hopper/expert-v0" in msg and "minari download mujoco/hopper/expert-v0" in msg
    assert str(minari_root()) in msg and "PRIMAL_DT_OFFLINE" in msg
    with pytest.raises(DatasetError, match="names a Minari dataset; data_source=replica cannot find it"):
        load_dataset("mujoco/hopper/medium-v0", source="replica", verbose=False)


@pytest.mark.parametrize("damage, words", [
    ("rewards link to itself", r"episodes cannot be read \(Special link traversal failed"),
    ("rewards as text", r"observations, actions and rewards are not numbers of one width in every episode"),
    ("actions of another width", r"observations, actions and rewards are not numbers of one width in every episode"),
])
def test_damaged_episode_arrays_are_one_error_naming_the_dataset(data_dirs, damage, words):
    """An episode group whose rewards link to themselves (h5py's RuntimeError), hold text or whose actions are of
    another width than the other episodes' (numpy's ValueError, without the dataset's name) was a traceback or a
    bare numpy message; it is one DatasetError naming the dataset."""
    import h5py

    path = write_minari("mujoco/hopper/medium-v0", _episodes(lengths=(3, 2), ends=("term", "trunc")), "Hopper-v5")
    with h5py.File(next((path / "data").glob("*.hdf5")), "a") as f:
        key = "episode_0/actions" if damage.startswith("actions") else "episode_0/rewards"
        n = len(f["episode_0/rewards"])
        del f[key]
        f[key] = {"rewards link to itself": h5py.SoftLink("/" + key), "rewards as text": np.array([b"a"] * n),
                  "actions of another width": np.zeros((n, 5), np.float32)}[damage]
    with pytest.raises(DatasetError, match=rf"minari.*mujoco/hopper/medium-v0.*{words}"):
        load_dataset("hopper-medium", source="minari", verbose=False)


def test_a_fifo_in_place_of_an_episode_file_is_refused_not_waited_on(data_dirs, run_code):
    """As a D4RL file: h5py opening a FIFO waits for a writer, forever (here in a process of its own, so that a
    reader that waits fails the test by its timeout)."""
    path = write_minari("mujoco/hopper/medium-v0", _episodes(lengths=(3,), ends=("term",)), "Hopper-v5")
    (h5,) = (path / "data").glob("*.hdf5")
    h5.unlink()
    os.mkfifo(h5)
    p = run_code("import envs\nenvs.load_dataset('hopper-medium', source='minari', verbose=False)", timeout=60)
    assert f"{h5.name} is not a regular file (a FIFO, socket, device or directory)" in p.stderr, p.stderr[-2000:]


def test_a_lean_install_is_told_the_extra_the_readme_names(data_dirs, monkeypatch):
    """Without huggingface_hub (the lean install: no ``download`` extra) the error names that extra, as the
    README does, not a package spec of its own. (The lean install is simulated: the dev one has the package.)"""
    import importlib.util

    from envs import minari_source

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "huggingface_hub"
                        else found(name, *a))
    with pytest.raises(DatasetNotFound, match=r"download extra installs: pip install 'primal-dt\[download\]'"):
        minari_source.download_minari("mujoco/hopper/medium-v0")
