"""D4RL Gym-MuJoCo HDF5 files: read them with h5py, write new ones in the same layout.

The ``d4rl`` package itself needs mujoco-py and old gym, so we read its files directly. Reading
turns every failure mode of a file (absent, unreadable, not HDF5, truncated, keys missing, arrays
of unequal length, of the wrong type or shape, recorded in another environment) into one
``DatasetError`` that names the file and the fix; the file is only ever opened read-only. Writing
goes to a temporary file renamed into place, so an interrupted write never leaves a half file
under the real name.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from envs.errors import DatasetError, DatasetNotFound
from primal_dt.run import json_reader
from envs.hdf5_limits import check_declared_sizes
from envs.registry import FAMILIES, EnvSpec, family_of
from envs.sources import Request, register
from envs.trajectories import Trajectories, split_on_ends

REQUIRED_KEYS = ("observations", "actions", "rewards", "terminals")
PROVENANCE_ATTR = "primal_dt_provenance"  # JSON written by envs.collect
ENV_KEYS = ("env_id", "env_name", "gym_id", "env", "environment")
"""names under which D4RL-format files record their environment (file or ``metadata`` attributes,
``metadata/<key>`` datasets); envs.collect's provenance records ``gym_id``"""
STEP_ARRAYS = ("rewards", "terminals", "timeouts")  # one value per step: [N] (or [N, 1])
FLAGS = ("terminals", "timeouts")


def d4rl_dir() -> Path:
    """Where D4RL keeps its downloads: $D4RL_DATASET_DIR or ~/.d4rl/datasets."""
    return Path(os.environ.get("D4RL_DATASET_DIR") or Path.home() / ".d4rl" / "datasets").expanduser()


def _read_array(f, key: str, where: str) -> np.ndarray:
    try:
        arr = np.asarray(f[key][()])
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise DatasetError(
            f"{where}: dataset '{key}' cannot be read ({exc}); the file is corrupt or truncated. "
            "Delete it and download or regenerate it."
        ) from exc
    if arr.dtype.kind not in "biuf":  # bool, integers, floats: strings, objects, complex and records are not data
        raise DatasetError(f"{where}: '{key}' holds values of type {arr.dtype}, expected numbers; the file was not "
                           "written as a D4RL dataset (or is damaged). Regenerate or re-download it.")
    if arr.ndim == 0 or (key in STEP_ARRAYS and not (arr.ndim == 1 or arr.shape[1:] == (1,))):
        raise DatasetError(f"{where}: '{key}' has shape {arr.shape}, expected "
                           f"{'one value per step, [steps]' if key in STEP_ARRAYS else '[steps, dim]'}")
    if key in FLAGS and arr.dtype.kind != "b" and not np.isin(arr, (0, 1)).all():
        bad = arr[~np.isin(arr, (0, 1))]
        raise DatasetError(f"{where}: '{key}' holds {bad.size} value(s) other than 0 and 1 (e.g. {bad.flat[0]!r}); "
                           "episode-end flags must be booleans. The file is corrupt; regenerate or re-download it.")
    return arr


def _text(value) -> str | None:
    value = value[()] if hasattr(value, "shape") and value.shape == () else value
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) and value.strip() else None


def recorded_env(f, provenance: dict) -> tuple[str, str] | None:
    """(environment id, where in the file) that a D4RL-format file records, if any: envs.collect's
    provenance, else an ``env_id`` / ``env_name`` / ... attribute of the file or of its ``metadata``
    group, or a ``metadata/<key>`` string dataset."""
    if _text(provenance.get("gym_id")):
        return provenance["gym_id"], f"attribute {PROVENANCE_ATTR}.gym_id"
    meta = f.get("metadata") if "metadata" in f else None
    for key in ENV_KEYS:
        places = [(f.attrs, f"attribute {key}")]
        if meta is not None and hasattr(meta, "attrs"):
            places += [(meta.attrs, f"attribute metadata.{key}")]
            if hasattr(meta, "keys") and key in meta and hasattr(meta[key], "shape"):
                places += [({key: meta[key]}, f"dataset metadata/{key}")]
        for attrs, where in places:
            try:
                text = _text(attrs.get(key)) if key in attrs else None
            except (OSError, TypeError, ValueError):
                text = None
            if text:
                return text, where
    return None


@register("d4rl", "PATH", "a D4RL HDF5 file (without PATH: <family>_<level>-v2.hdf5 in $D4RL_DATASET_DIR or "
          "~/.d4rl/datasets)", label="D4RL")
def read_source(req: Request) -> Trajectories:
    spec = req.spec
    if req.where:
        return read_d4rl(req.where, spec.name, spec.gym_id, spec.max_episode_steps, req.verbose)
    root = d4rl_dir()
    ds = read_named(spec, lambda level: root / f"{spec.family}_{level.replace('-', '_')}-v2.hdf5", req.verbose)
    if ds is None:
        pair = " (nor both its medium and expert files)" if spec.level == "medium-expert" else ""
        raise DatasetNotFound(f"no {root / spec.d4rl_file}{pair}; put the D4RL file there ($D4RL_DATASET_DIR)")
    return ds


def read_named(spec: EnvSpec, path_of, verbose: bool = True) -> Trajectories | None:
    """The file ``path_of(level)`` of ``spec``'s level, or for medium-expert (which D4RL also ships as two
    files) the medium and expert files joined; None when they are not there."""
    paths = [path_of(spec.level)]
    if not paths[0].exists():
        paths = [path_of(lv) for lv in ("medium", "expert")] if spec.level == "medium-expert" else []
        if not paths or not all(p.exists() for p in paths):
            return None
    sub = [read_d4rl(p, spec.name, spec.gym_id, spec.max_episode_steps, verbose) for p in paths]
    if len(sub) == 1:
        return sub[0]
    return Trajectories.concat(sub, name=spec.name, gym_id=spec.gym_id, source="d4rl:" + "+".join(map(str, paths)),
                               metadata=sub[0].metadata)


def read_d4rl(path: str | Path, name: str | None = None, gym_id: str | None = None,
              max_episode_steps: int = 1000, verbose: bool = True) -> Trajectories:
    """Episodes of a D4RL-format file, split on terminals or timeouts, float32.

    ``name``/``gym_id`` switch on the check that dimensions match that simulator. A file without
    ``timeouts`` (D4RL v0) has its episodes cut at the simulator's limit, ``max_episode_steps``, and says
    so (``verbose``).
    """
    import h5py

    path = Path(path).expanduser()
    where = str(path)
    if not path.exists():
        raise DatasetNotFound(f"no D4RL file at {path}")
    if path.is_dir():
        raise DatasetError(f"{where} is a directory, expected a D4RL .hdf5 file")
    if not os.access(path, os.R_OK):
        raise DatasetError(f"{where} cannot be read: permission denied. Give this user read access "
                           f"(chmod +r {path}) or copy the file somewhere readable")
    try:
        f = h5py.File(path, "r")
    except PermissionError as exc:
        raise DatasetError(f"{where} cannot be read: permission denied ({exc}). Give this user read access "
                           f"(chmod +r {path}) or copy the file somewhere readable") from exc
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
        has_timeouts = "timeouts" in f
        keys = REQUIRED_KEYS + (("timeouts",) if has_timeouts else ())
        check_declared_sizes([f[k] for k in keys if hasattr(f[k], "shape")], path)
        data = {k: _read_array(f, k, where) for k in REQUIRED_KEYS}
        if has_timeouts:
            data["timeouts"] = _read_array(f, "timeouts", where)
        provenance = {}
        if PROVENANCE_ATTR in f.attrs:
            try:
                provenance = json_reader.parse(f.attrs[PROVENANCE_ATTR], f"{where} attribute {PROVENANCE_ATTR}")
            except (TypeError, ValueError) as err:
                raise DatasetError(f"{err}; the file's provenance is damaged: regenerate the file "
                                   "(python -m envs.collect)") from None
            if not isinstance(provenance, dict):
                raise DatasetError(f"{where} attribute {PROVENANCE_ATTR} must be a JSON object; the file's "
                                   "provenance is damaged: regenerate the file (python -m envs.collect)")
        recorded = recorded_env(f, provenance)
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
        data["timeouts"] = _cut_at_limit(data["terminals"], where, gym_id, max_episode_steps, verbose)
    if recorded is not None and gym_id:
        env_id, found = recorded
        if family_of(env_id) != family_of(gym_id):
            raise DatasetError(
                f"{where} records environment {env_id!r} ({found}), but {name or gym_id} is data of {gym_id}: "
                "the file belongs to another environment, and training on it would be silently wrong even where "
                "the dimensions agree. Put it under its own name, or pick the dataset name that matches it."
            )
        if found.startswith(f"attribute {PROVENANCE_ATTR}"):
            gym_id = env_id  # a file made by envs.collect says which simulator version it used
    starts, lengths, terminal, keep = split_on_ends(data["terminals"], data["timeouts"], where, max_episode_steps,
                                                    name or gym_id or "the task")
    return Trajectories(
        observations=data["observations"][:keep],
        actions=data["actions"][:keep], rewards=data["rewards"][:keep],
        starts=starts, lengths=lengths, terminal=terminal, name=name, gym_id=gym_id,
        source=f"d4rl:{path}", metadata=provenance,
    )


def _cut_at_limit(terminals: np.ndarray, where: str, gym_id: str | None, limit: int, verbose: bool) -> np.ndarray:
    """Timeouts for a file that records none (D4RL v0): an episode also ends after ``limit`` steps
    without a terminal. A file of a simulator whose episodes terminate (the hopper falls) that records no
    terminal either has lost its episode ends: cutting at the limit would join episodes into ones whose
    returns are several real ones', so it is refused."""
    term = np.asarray(terminals).reshape(-1).astype(bool)
    family = family_of(gym_id) if gym_id else None
    if not term.any() and family is not None and FAMILIES[family].terminates:
        raise DatasetError(
            f"{where}: records no episode end at all (no 'timeouts' key, and none of its {len(term):,} terminals is "
            f"set), but {gym_id}'s episodes end when the robot falls: its episode boundaries were lost (terminals "
            "zeroed in a conversion?). Use a file with its terminals, or with a 'timeouts' key")
    timeouts = np.zeros(len(term), dtype=bool)
    step = 0
    for i, t in enumerate(term.tolist()):
        step += 1
        if t or step == limit:
            timeouts[i] = not t
            step = 0
    if verbose:
        print(f"[envs] note: {where} has no 'timeouts' key: episodes end at a terminal or after {limit} steps "
              f"(the simulator's limit), {int(timeouts.sum())} of them so", file=sys.stderr, flush=True)
    return timeouts


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
