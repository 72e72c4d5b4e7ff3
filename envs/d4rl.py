"""D4RL Gym-MuJoCo HDF5 files: read them with h5py, write new ones in the same layout.

The ``d4rl`` package itself needs mujoco-py and old gym, so we read its files directly. Reading
turns every failure mode of a file (absent, not HDF5, truncated, keys missing, arrays of unequal
length) into one ``DatasetError`` that names the file and the fix. Writing goes to a temporary
file renamed into place, so an interrupted write never leaves a half file under the real name.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np

from envs.errors import DatasetError, DatasetNotFound
from envs.trajectories import Trajectories, split_on_ends

REQUIRED_KEYS = ("observations", "actions", "rewards", "terminals")
PROVENANCE_ATTR = "primal_dt_provenance"  # JSON written by envs.collect


def d4rl_dir() -> Path:
    """Where D4RL keeps its downloads: $D4RL_DATASET_DIR or ~/.d4rl/datasets."""
    return Path(os.environ.get("D4RL_DATASET_DIR") or Path.home() / ".d4rl" / "datasets").expanduser()


def _read_array(f, key: str, where: str) -> np.ndarray:
    try:
        return np.asarray(f[key][()])
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise DatasetError(
            f"{where}: dataset '{key}' cannot be read ({exc}); the file is corrupt or truncated. "
            "Delete it and download or regenerate it."
        ) from exc


def read_d4rl(path: str | Path, name: str | None = None, gym_id: str | None = None,
              max_episode_steps: int = 1000) -> Trajectories:
    """Episodes of a D4RL-format file, split on terminals or timeouts, float32.

    ``name``/``gym_id`` switch on the check that dimensions match that simulator.
    """
    import h5py

    path = Path(path).expanduser()
    where = str(path)
    if not path.exists():
        raise DatasetNotFound(f"no D4RL file at {path}")
    if path.is_dir():
        raise DatasetError(f"{where} is a directory, expected a D4RL .hdf5 file")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DatasetError(
            f"{where} is not a readable HDF5 file ({exc}). It is probably truncated by an "
            "interrupted download or copy; delete it and download it again."
        ) from exc
    with f:
        missing = [k for k in REQUIRED_KEYS if k not in f]
        if missing:
            raise DatasetError(
                f"{where}: missing key(s) {missing}; a D4RL Gym-MuJoCo file has "
                f"{list(REQUIRED_KEYS) + ['timeouts']} (found {sorted(f.keys())})"
            )
        data = {k: _read_array(f, k, where) for k in REQUIRED_KEYS}
        has_timeouts = "timeouts" in f
        if has_timeouts:
            data["timeouts"] = _read_array(f, "timeouts", where)
        provenance = {}
        if PROVENANCE_ATTR in f.attrs:
            try:
                provenance = json.loads(f.attrs[PROVENANCE_ATTR])
            except (TypeError, ValueError):
                provenance = {}
    n = len(data["rewards"])
    lens = {k: len(v) for k, v in data.items()}
    if len(set(lens.values())) != 1:
        raise DatasetError(
            f"{where}: arrays differ in length {lens}; the file was truncated while being "
            "written. Delete it and download or regenerate it."
        )
    if n == 0:
        raise DatasetError(f"{where}: the dataset is empty (0 steps)")
    if not has_timeouts:
        # D4RL v0 files had no timeouts; their episodes were cut every max_episode_steps steps.
        warnings.warn(f"{where}: no 'timeouts' key; assuming episodes of at most "
                      f"{max_episode_steps} steps (D4RL v0 convention)", stacklevel=2)
        timeouts = np.zeros(n, dtype=bool)
        step = 0
        term = data["terminals"].astype(bool)
        for i in range(n):
            step += 1
            if term[i] or step == max_episode_steps:
                timeouts[i] = not term[i]
                step = 0
        data["timeouts"] = timeouts
    recorded = provenance.get("gym_id")
    if recorded and gym_id and recorded.split("-v")[0] == gym_id.split("-v")[0]:
        gym_id = recorded  # a file made by envs.collect says which simulator version it used
    starts, lengths, terminal, keep = split_on_ends(data["terminals"], data["timeouts"], where)
    return Trajectories(
        observations=data["observations"][:keep],
        actions=data["actions"][:keep], rewards=data["rewards"][:keep],
        starts=starts, lengths=lengths, terminal=terminal, name=name, gym_id=gym_id,
        source=f"d4rl:{path}", metadata=provenance,
    )


def trajectories_to_arrays(traj: Trajectories) -> dict[str, np.ndarray]:
    """The D4RL flag arrays of a Trajectories (next_observations needs final states, so not here)."""
    ends = traj.starts + traj.lengths - 1
    terminals = np.zeros(traj.num_steps, dtype=bool)
    timeouts = np.zeros(traj.num_steps, dtype=bool)
    terminals[ends] = traj.terminal
    timeouts[ends] = ~traj.terminal
    return {"observations": traj.observations, "actions": traj.actions, "rewards": traj.rewards,
            "terminals": terminals, "timeouts": timeouts}


def write_d4rl(path: str | Path, arrays: dict[str, np.ndarray], provenance: dict | None = None,
               compression: str | None = "gzip", level: int = 9) -> Path:
    """Write D4RL-layout arrays (observations, actions, rewards, terminals, timeouts and
    optionally next_observations) atomically; floats as float32, flags as bool."""
    import h5py

    missing = [k for k in REQUIRED_KEYS + ("timeouts",) if k not in arrays]
    if missing:
        raise ValueError(f"write_d4rl needs arrays {missing}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            for key, arr in arrays.items():
                arr = np.asarray(arr)
                arr = arr.astype(bool) if key in ("terminals", "timeouts") else arr.astype(np.float32)
                kw = {}
                if compression and arr.size > 0:
                    kw = {"compression": compression, "shuffle": True, "chunks": True}
                    if compression == "gzip":
                        kw["compression_opts"] = level
                f.create_dataset(key, data=arr, **kw)
            if provenance is not None:
                f.attrs[PROVENANCE_ATTR] = json.dumps(provenance, sort_keys=True, default=str)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
