"""D4RL HDF5 files: splitting, returns-to-go and every bad file we promise a clear error for.
All files are real HDF5 written with h5py here."""

import os
import warnings

import h5py
import numpy as np
import pytest

from envs import DatasetError, Trajectories, load_dataset
from envs.d4rl import read_d4rl, write_d4rl
from envs.sources import DatasetNotFound


def d4rl_arrays(traj):
    """D4RL's arrays of a Trajectories: its episode ends as terminals or timeouts."""
    ends = traj.starts + traj.lengths - 1
    terminals, timeouts = np.zeros(traj.num_steps, bool), np.zeros(traj.num_steps, bool)
    terminals[ends], timeouts[ends] = traj.terminal, ~traj.terminal
    return {"observations": traj.observations, "actions": traj.actions, "rewards": traj.rewards,
            "terminals": terminals, "timeouts": timeouts}


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


def test_missing_timeouts_falls_back_to_episode_limit(tmp_path, write_h5, toy, capsys):
    toy = {k: v for k, v in toy.items() if k != "timeouts"}
    ds = read_d4rl(write_h5(tmp_path / "v0.hdf5", **toy), max_episode_steps=2)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"[envs] note: {tmp_path / 'v0.hdf5'} has no 'timeouts' key: episodes end at a terminal or after 2 "
                   "steps (the simulator's limit), 3 of them so"]
    # terminal at 2 -> [0,1] cut by limit, [2] terminal; then [3,4], [5,6] cut, 7 dropped
    assert ds.lengths.tolist() == [2, 1, 2, 2] and ds.terminal.tolist() == [False, True, False, False]


def test_write_then_read_round_trip_is_atomic(tmp_path, write_h5, toy):
    ds = read_d4rl(write_h5(tmp_path / "src.hdf5", **toy))
    out = write_d4rl(tmp_path / "out" / "x.hdf5", d4rl_arrays(ds), {"policy_step": 7})
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
    with pytest.raises(DatasetError, match="no D4RL file at .*asked for by data_source="):
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


# --- the environment a file records ------------------------------------------------------------
def test_a_file_recorded_in_another_environment_is_refused(data_dirs, write_h5):
    """Same dimensions (halfcheetah and walker2d both observe 17 and act in 6), other simulator: the
    environment the file records decides, wherever it records it."""
    rng = np.random.default_rng(0)
    arrays = {"observations": rng.standard_normal((6, 17)), "actions": rng.uniform(-1, 1, (6, 6)), "rewards": np.ones(6),
              "terminals": np.array([0, 0, 1, 0, 0, 1], bool), "timeouts": np.zeros(6, bool)}
    path = data_dirs["d4rl"] / "walker2d_medium-v2.hdf5"
    write_d4rl(path, arrays, {"gym_id": "HalfCheetah-v4", "policy_step": 3})  # what envs.collect records
    with pytest.raises(DatasetError, match=r"records environment 'HalfCheetah-v4' \(attribute primal_dt_provenance"
                                           r".gym_id\), but walker2d-medium is data of Walker2d-v4"):
        load_dataset("walker2d-medium", verbose=False)
    for place in ("attrs", "metadata attrs", "metadata dataset"):
        write_h5(path, **arrays)
        with h5py.File(path, "a") as f:
            if place == "attrs":
                f.attrs["env_name"] = "halfcheetah-medium-v2"
            elif place == "metadata attrs":
                f.create_group("metadata").attrs["env_id"] = "HalfCheetah-v4"
            else:
                f.create_dataset("metadata/env_name", data=b"halfcheetah-medium-v2")
        with pytest.raises(DatasetError, match="belongs to another environment"):
            load_dataset("walker2d-medium", verbose=False)
    with h5py.File(path, "a") as f:
        del f["metadata/env_name"]
        f["metadata"].attrs["env_name"] = "walker2d-medium-v2"  # its own name: fine
    assert load_dataset("walker2d-medium", verbose=False).num_steps == 6


@pytest.mark.parametrize("key, value, message", [
    ("observations", np.array([[b"ab"] * 11] * 8), "'observations' holds values of type |S2, expected numbers"),
    ("rewards", np.arange(8) * (1 + 1j), "'rewards' holds values of type complex128"),
    ("rewards", np.ones((8, 2)), r"'rewards' has shape \(8, 2\), expected one value per step"),
    ("terminals", np.array([0, 0, 1, 0, 0, 0, 0, np.nan]), "'terminals' holds 1 value.* other than 0 and 1 .*nan"),
    ("observations", np.float64(3.0), r"'observations' has shape \(\)"),
])
def test_values_of_the_wrong_kind_or_shape(tmp_path, write_h5, toy, key, value, message):
    path = write_h5(tmp_path / "w.hdf5", **dict(toy, **{key: value}))
    with pytest.raises(DatasetError, match=f"{path}: {message}"):
        read_d4rl(path)


@pytest.mark.parametrize("text, problem", [("{not json", "is not valid JSON"), ("[1, 2]", "must be a JSON object"),
                                           ("[" * 5000 + "]" * 5000, "levels deep"),
                                           (np.arange(3), "is not JSON text")])
def test_a_damaged_provenance_is_one_error_naming_the_file(tmp_path, write_h5, toy, text, problem):
    """envs.collect's provenance attribute is read bounded and checked (D4RL files and Minari metadata share
    the reader): damaged, it is one DatasetError naming the file, never a traceback or a silent {}."""
    path = write_h5(tmp_path / "p.hdf5", **toy)
    with h5py.File(path, "a") as f:
        f.attrs["primal_dt_provenance"] = text
    with pytest.raises(DatasetError, match=rf"{path} attribute primal_dt_provenance .*{problem}.*provenance is damaged"):
        read_d4rl(path)


def test_an_unreadable_file_says_permission_denied_not_truncated(tmp_path, write_h5, toy, run_code):
    path = write_h5(tmp_path / "locked.hdf5", **toy)
    path.chmod(0o200)
    p = run_code(f"from envs.d4rl import read_d4rl\nread_d4rl({str(path)!r})", honour_permissions=True)
    assert f"DatasetError: {path} cannot be read: permission denied" in p.stderr, p.stderr[-2000:]
    assert "truncated" not in p.stderr


# --- randomly broken files ---------------------------------------------------------------------
KEYS = ("observations", "actions", "rewards", "terminals", "timeouts")


@pytest.fixture(scope="module")
def hopper_arrays(hopper_file):
    with h5py.File(hopper_file) as f:
        return {k: f[k][()] for k in f}


def _mutations():
    from hypothesis import strategies as st

    return st.lists(st.one_of(
        st.tuples(st.just("drop"), st.sampled_from(KEYS)),
        st.tuples(st.just("dtype"), st.sampled_from(KEYS),
                  st.sampled_from(["int8", "uint8", "int64", "float16", "float64", "bool", "S4", "complex64"])),
        st.tuples(st.just("shape"), st.sampled_from(KEYS),
                  st.sampled_from(["flatten", "add_axis", "transpose", "half_rows", "first_cols", "scalar", "empty"])),
        st.tuples(st.just("nonfinite"), st.sampled_from(KEYS), st.sampled_from([np.nan, np.inf, -np.inf]),
                  st.integers(0, 10**6)),
        st.tuples(st.just("truncate"), st.floats(0, 1)),
    ), min_size=1, max_size=3)


def _break(arrays: dict, mutations) -> tuple[dict, float | None]:
    out, cut = dict(arrays), None
    for m in mutations:
        kind, key = m[0], m[1]
        if kind == "truncate":
            cut = key
        elif key not in out or np.ndim(out[key]) == 0:
            continue
        elif kind == "drop":
            del out[key]
        elif kind == "dtype":
            try:
                out[key] = out[key].astype(m[2]) if m[2] != "S4" else out[key].astype(str).astype("S4")
            except (ValueError, TypeError):  # strings do not become numbers again
                continue
        elif kind == "shape":
            a = out[key]
            out[key] = {"flatten": lambda: a.reshape(-1), "add_axis": lambda: a[:, None], "transpose": lambda: a.T,
                        "half_rows": lambda: a[: len(a) // 2], "first_cols": lambda: a[:, :1] if a.ndim == 2 else a,
                        "scalar": lambda: a.reshape(-1)[0] if a.size else a, "empty": lambda: a[:0]}[m[2]]()
        elif kind == "nonfinite":
            if out[key].dtype.kind not in "biuf":
                continue
            a = out[key].astype(np.float64)
            if a.size:
                a.reshape(-1)[m[3] % a.size] = m[2]
            out[key] = a
    return out, cut


def _check_broken_files(tmp_path, arrays, examples):
    from hypothesis import HealthCheck, given, settings

    count = iter(range(10**9))

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_mutations())
    def prop(mutations):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # casting NaN or complex values while breaking the file
            broken, cut = _break(arrays, mutations)
        path = tmp_path / f"broken-{next(count)}.hdf5"
        with h5py.File(path, "w") as f:
            for k, v in broken.items():
                f.create_dataset(k, data=v)
        if cut is not None:
            data = path.read_bytes()
            path.write_bytes(data[: int(cut * len(data))])
        before = path.read_bytes()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a file without timeouts loads with a warning
                ds = load_dataset("hopper-medium", source=f"d4rl:{path}", verbose=False)
        except DatasetError as err:
            assert str(path) in str(err), str(err)
        else:  # a correct load: the file's own values, in the simulator's dimensions and box
            n = ds.num_steps
            for k in ("observations", "actions"):
                np.testing.assert_array_equal(getattr(ds, k), np.asarray(broken[k], np.float32)[:n])
            np.testing.assert_array_equal(ds.rewards, np.asarray(broken["rewards"], np.float32).reshape(-1)[:n])
            assert ds.observations.shape[1:] == (11,) and ds.actions.shape[1:] == (3,)
            assert np.isfinite(ds.observations).all() and (abs(ds.actions) <= 1).all() and n == ds.lengths.sum()
        assert path.read_bytes() == before  # the file is never changed
        path.unlink()

    prop()


def test_randomly_broken_files_load_correctly_or_fail_clearly_and_stay_unchanged(tmp_path, hopper_arrays):
    _check_broken_files(tmp_path, hopper_arrays, examples=100)


@pytest.mark.slow
def test_many_randomly_broken_files(tmp_path, hopper_arrays):
    _check_broken_files(tmp_path, hopper_arrays, examples=3000)


def steps(n, terminals=(), timeouts=()):
    """A D4RL file's arrays of ``n`` steps with those flags set."""
    t, u = np.zeros(n, bool), np.zeros(n, bool)
    t[list(terminals)], u[list(timeouts)] = True, True
    g = np.random.default_rng(0)
    return {"observations": g.normal(size=(n, 11)), "actions": g.uniform(-1, 1, (n, 3)), "rewards": np.ones(n),
            "terminals": t, "timeouts": u}


def test_episodes_longer_than_the_tasks_limit_are_an_error_naming_the_file(tmp_path, write_h5):
    """Terminals lost in a conversion (all zero, timeouts intact) merge every fallen episode into the next
    timeout's: the episodes exceed Hopper's 1000 steps, and the file is refused at load instead of being
    trained on (or having most of its steps dropped as a "fragment")."""
    ends = np.cumsum(np.random.default_rng(1).integers(50, 400, 40)) - 1  # many short falls ...
    n = int(ends[-1]) + 1
    real = steps(n, terminals=ends[:-1], timeouts=ends[-1:])
    assert read_d4rl(write_h5(tmp_path / "ok.hdf5", **real), "hopper-medium", "Hopper-v4").num_steps == n
    lost = dict(real, terminals=np.zeros(n, bool), timeouts=np.isin(np.arange(n), ends[9::10]))  # ... now 4 long
    path = write_h5(tmp_path / "lost.hdf5", **lost)
    with pytest.raises(DatasetError, match=rf"^{path}: episode 0 \(steps 0 to {ends[9]}\) is {ends[9] + 1} steps "
                                           r"long, more than hopper-medium's limit of 1000 .*0 terminals and 4 "
                                           r"timeouts.*terminals all zero"):
        read_d4rl(path, "hopper-medium", "Hopper-v4")
    tail = write_h5(tmp_path / "tail.hdf5", **steps(3000, timeouts=[999]))  # 2000 steps after the last end
    with pytest.raises(DatasetError, match="the unfinished fragment after the last episode end is 2000 steps long"):
        read_d4rl(tail, "hopper-medium", "Hopper-v4")
    with pytest.raises(DatasetError, match="lost.hdf5: episode 0"):  # through the loader, with the registry's limit
        load_dataset("hopper-medium", source=f"d4rl:{path}", verbose=False)


@pytest.mark.parametrize("link", ["external rewards", "looping rewards", "looping metadata", "external metadata entry"])
def test_a_link_to_a_missing_file_or_to_itself_is_one_error_naming_the_file(tmp_path, write_h5, toy, link):
    """HDF5 names may be links: to an absent file, or to themselves. D4RL files hold none; such a file was h5py's
    KeyError / RuntimeError traceback, now one DatasetError naming it."""
    path = write_h5(tmp_path / "l.hdf5", **toy)
    with h5py.File(path, "a") as f:
        if link.endswith("rewards"):
            del f["rewards"]
        f[{"external rewards": "rewards", "looping rewards": "rewards", "looping metadata": "metadata",
           "external metadata entry": "metadata/env_name"}[link]] = (
            h5py.ExternalLink(str(tmp_path / "absent.h5"), "/r") if link.startswith("external")
            else h5py.SoftLink("/" + link.split()[1]))
    with pytest.raises(DatasetError, match=rf"^{path}: an entry of the file cannot be opened .* links to another "
                                           "file or to itself"):
        read_d4rl(path, "hopper-medium", "Hopper-v4")


def test_a_file_recording_a_simulator_primal_dt_cannot_run_is_refused_when_read(tmp_path, toy):
    """A provenance naming Hopper-v99 passed every check and trained until the first evaluation built the simulator
    (gymnasium's traceback, and no checkpoint yet): the recorded simulator is checked when the data is read."""
    path = write_d4rl(tmp_path / "v.hdf5", toy, {"gym_id": "Hopper-v99"})
    with pytest.raises(DatasetError, match=r"records simulator 'Hopper-v99', which primal-dt cannot run; "
                                           r"hopper-medium's data comes from Hopper-v4 or Hopper-v5"):
        read_d4rl(path, "hopper-medium", "Hopper-v4")
    write_d4rl(path, toy, {"gym_id": "Hopper-v5"})  # the Minari simulator, which primal-dt runs
    assert read_d4rl(path, "hopper-medium", "Hopper-v4").gym_id == "Hopper-v5"


def test_a_fifo_planted_in_place_of_the_file_is_refused_not_waited_on(tmp_path, run_code):
    """Opening a FIFO for reading waits for a writer: a FIFO named like the dataset (planted in a shared datasets
    folder) hung the run before its first line. It is refused as not a regular file (in a process of its own, so
    that a reader that waits fails the test by its timeout instead of hanging it)."""
    fifo = tmp_path / "hopper_medium-v2.hdf5"
    os.mkfifo(fifo)
    p = run_code(f"from envs.d4rl import read_d4rl\nread_d4rl({str(fifo)!r})", timeout=60)
    assert f"DatasetError: {fifo} is not a regular file (a FIFO, socket or device)" in p.stderr, p.stderr[-2000:]
