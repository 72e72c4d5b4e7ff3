"""D4RL Gym-MuJoCo HDF5 files, read with h5py (the ``d4rl`` package needs mujoco-py and old gym), downloaded
from D4RL's server when a name's file is missing (``envs.download``), and written in the same layout. Every
failure mode of a file (absent, unreadable, not HDF5, truncated, keys missing, arrays of unequal length, type
or shape, another environment's) is one ``DatasetError`` naming the file and the fix; files are only opened
read-only, and written atomically (``checkpoint.write_atomic``)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

import h5py
import numpy as np

from envs.download import fetch
from envs.registry import FAMILIES, EnvSpec, family_of
from envs.sources import DatasetError, DatasetNotFound, Request, register
from envs.trajectories import Trajectories, split_on_ends
from primal_dt.run import json_reader
from primal_dt.run.checkpoint import write_atomic

REQUIRED_KEYS = ("observations", "actions", "rewards", "terminals")
PROVENANCE_ATTR = "primal_dt_provenance"  # JSON written by envs.collect
ENV_KEYS = ("env_id", "env_name", "gym_id", "env", "environment")
"""names under which D4RL-format files record their environment (file or ``metadata`` attributes,
``metadata/<key>`` datasets)"""
STEP_ARRAYS = ("rewards", "terminals", "timeouts")  # one value per step: [N] (or [N, 1])
FLAGS = ("terminals", "timeouts")
MAX_VALUES = 2**33
"""values one HDF5 dataset may declare: far above any offline RL dataset (D4RL's largest hold a few 10**7)"""
MAX_RATIO = 1000
"""declared bytes per byte of file: above what compression achieves on recorded data"""


D4RL_URL = "http://rail.eecs.berkeley.edu/datasets/offline_rl/gym_mujoco_v2"
"""where d4rl's own URL table puts the v2 Gym-MuJoCo files (``<family>_<level>-v2.hdf5``); $PRIMAL_DT_D4RL_URL
replaces it (a mirror, a test's server)"""


def d4rl_dir() -> Path:
    return Path(os.environ.get("D4RL_DATASET_DIR") or Path.home() / ".d4rl" / "datasets").expanduser()


def d4rl_url(spec: EnvSpec) -> str:
    return f"{(os.environ.get('PRIMAL_DT_D4RL_URL') or D4RL_URL).rstrip('/')}/{spec.d4rl_file}"


def check_declared_sizes(datasets, path: Path) -> None:
    """Refuse h5py ``datasets`` whose declared shapes are absurd, before any is read: a file can declare 10**11
    rows in a few hundred bytes, and reading them would try to allocate all of them."""
    total = 0
    for ds in datasets:
        values = math.prod(ds.shape or ())
        if values > MAX_VALUES:
            raise DatasetError(f"{path}: dataset '{ds.name.lstrip('/')}' declares shape {ds.shape} ({values:.3g} values, "
                               f"more than the {MAX_VALUES:.3g} a dataset may hold); the file is corrupt or not data. "
                               "Regenerate or re-download it")
        total += values * ds.dtype.itemsize
    size = Path(path).stat().st_size
    if total > MAX_RATIO * size + 2**20:
        raise DatasetError(f"{path}: its datasets declare {total:.3g} bytes, but the file holds {size:,} bytes (more "
                           f"than {MAX_RATIO}x what compression reaches); the file is truncated or corrupt. "
                           "Regenerate or re-download it")


def _read_array(f, key: str, where: str) -> np.ndarray:
    try:
        arr = np.asarray(f[key][()])
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise DatasetError(f"{where}: dataset '{key}' cannot be read ({exc}); the file is corrupt or truncated. "
                           "Delete it and download or regenerate it.") from exc
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


def parse_provenance(text, where: str) -> dict:
    """``envs.collect``'s provenance (JSON text); a damaged one is one error."""
    try:
        value = json_reader.parse(text, where)
        problem = None if isinstance(value, dict) else f"{where} must be a JSON object"
    except (TypeError, ValueError) as err:
        problem = (err if isinstance(err, json_reader.JSONError)
                   else f"{where} is not JSON text (it holds {type(text).__name__})")
    if problem:
        raise DatasetError(f"{problem}; its provenance is damaged: regenerate it (python -m envs.collect)")
    return value


def _text(value) -> str | None:
    value = value[()] if hasattr(value, "shape") and value.shape == () else value
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) and value.strip() else None


def recorded_env(f, provenance: dict) -> tuple[str, str] | None:
    """(environment id, where in the file) that a D4RL-format file records, if any."""
    if _text(provenance.get("gym_id")):
        return provenance["gym_id"], f"attribute {PROVENANCE_ATTR}.gym_id"
    meta = f.get("metadata")
    for key in ENV_KEYS:
        places = [(f.attrs, f"attribute {key}")]
        if meta is not None and hasattr(meta, "attrs"):
            places += [(meta.attrs, f"attribute metadata.{key}")]
            if hasattr(meta, "keys") and key in meta and hasattr(meta[key], "shape"):
                places += [({key: meta[key]}, f"dataset metadata/{key}")]
        for attrs, where in places:
            with contextlib.suppress(OSError, TypeError, ValueError):
                if key in attrs and (text := _text(attrs.get(key))):
                    return text, where
    return None


@register("d4rl", "PATH", "a D4RL HDF5 file (without PATH: <family>_<level>-v2.hdf5 in $D4RL_DATASET_DIR or "
          "~/.d4rl/datasets, downloaded there from D4RL's server if missing)", label="D4RL")
def read_source(req: Request) -> Trajectories:
    spec = req.spec
    ds = read_named(req, [d4rl_dir()], lambda level: f"{spec.family}_{level.replace('-', '_')}-v2.hdf5")
    if ds is not None:
        return ds
    target, url = d4rl_dir() / spec.d4rl_file, d4rl_url(spec)
    by_hand = f"put {spec.d4rl_file} in {target.parent} by hand ($D4RL_DATASET_DIR), from {url}"
    if not req.download:
        pair = " (nor both its medium and expert files)" if spec.level == "medium-expert" else ""
        raise DatasetNotFound(f"no {target}{pair}; {by_hand} on a connected machine, or allow the download "
                              "(unset PRIMAL_DT_OFFLINE)")
    if urlparse(url).scheme not in ("http", "https") or not urlparse(url).hostname:
        raise DatasetError(f"PRIMAL_DT_D4RL_URL={os.environ.get('PRIMAL_DT_D4RL_URL')!r} is not an http:// or https:// "
                           "address; set it to the folder of a D4RL mirror (the file name is appended) or unset it")
    try:
        fetch(url, target, lambda part: read_d4rl(part, spec.name, spec.gym_id, spec.max_episode_steps, False),
              what=f"the D4RL dataset {spec.name}", verbose=req.verbose)
    except DatasetNotFound as err:
        msg = f"{err}. Run again to retry, or {by_hand}; PRIMAL_DT_OFFLINE=1 skips the download"
        if req.verbose:  # the search goes on to the next source: say why this one was passed over
            print(f"[envs] d4rl: {msg}", file=sys.stderr, flush=True)
        raise DatasetNotFound(msg) from err
    return read_d4rl(target, spec.name, spec.gym_id, spec.max_episode_steps, req.verbose)


def read_named(req: Request, dirs: list[Path], file_of) -> Trajectories | None:
    """The D4RL-format file at ``req.where``, else the file ``file_of(level)`` of the name's level in the first of
    ``dirs`` that has it (medium-expert: else its medium and expert files, joined); None when none has."""
    spec = req.spec
    if req.where:
        return read_d4rl(req.where, spec.name, spec.gym_id, spec.max_episode_steps, req.verbose)
    for d in dirs:
        paths = [d / file_of(spec.level)]
        if not paths[0].exists() and spec.level == "medium-expert":
            paths = [d / file_of(level) for level in ("medium", "expert")]
        if all(p.exists() for p in paths):
            sub = [read_d4rl(p, spec.name, spec.gym_id, spec.max_episode_steps, req.verbose) for p in paths]
            return Trajectories.concat(sub, name=spec.name, gym_id=spec.gym_id, metadata=sub[0].metadata,
                                       source="d4rl:" + "+".join(map(str, paths)))
    return None


def read_d4rl(path: str | Path, name: str | None = None, gym_id: str | None = None,
              max_episode_steps: int = 1000, verbose: bool = True) -> Trajectories:
    """Episodes of a D4RL-format file, split on terminals or timeouts. ``name``/``gym_id`` switch on the check
    that dimensions match that simulator; a file without ``timeouts`` (D4RL v0) is cut at its step limit."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DatasetNotFound(f"no D4RL file at {path}")
    if path.is_dir():
        raise DatasetError(f"{path} is a directory, expected a D4RL .hdf5 file")
    if not path.is_file():  # opening a FIFO waits for a writer: forever
        raise DatasetError(f"{path} is not a regular file (a FIFO, socket or device), expected a D4RL .hdf5 file")
    try:  # no HDF5 file lock: files are replaced by rename, never written in place, and a download holds a lock
        f = h5py.File(path, "r", locking=False)  # on the file it checks here (file systems without flock refuse it)
    except OSError as exc:
        if not os.access(path, os.R_OK):
            raise DatasetError(f"{path} cannot be read: permission denied. Give this user read access "
                               f"(chmod +r {path}) or copy the file somewhere readable") from exc
        raise DatasetError(f"{path} is not a readable HDF5 file ({exc}). It is probably truncated by an interrupted "
                           "download or copy; delete it and download it again.") from exc
    with f:
        missing = [k for k in REQUIRED_KEYS if k not in f]
        if missing:
            raise DatasetError(f"{path}: missing key(s) {missing}; a D4RL Gym-MuJoCo file has "
                               f"{list(REQUIRED_KEYS) + ['timeouts']} (found {sorted(f.keys())})")
        keys = REQUIRED_KEYS + (("timeouts",) if "timeouts" in f else ())
        try:  # a name may be a link to another file that is not there, or a link to itself
            entries = [f[k] for k in keys]
            provenance = parse_provenance(f.attrs.get(PROVENANCE_ATTR, "{}"), f"{path} attribute {PROVENANCE_ATTR}")
            recorded = recorded_env(f, provenance)
        except (KeyError, RuntimeError, OSError) as exc:
            raise DatasetError(f"{path}: an entry of the file cannot be opened ({exc}); it links to another file or "
                               "to itself, which a D4RL dataset never does. The file is corrupt or not a D4RL "
                               "dataset; regenerate or re-download it.") from exc
        check_declared_sizes([e for e in entries if hasattr(e, "shape")], path)
        data = {k: _read_array(f, k, path) for k in keys}
    lens = {k: len(v) for k, v in data.items()}
    if len(set(lens.values())) != 1:
        raise DatasetError(f"{path}: arrays differ in length {lens}; the file was truncated while being written. "
                           "Delete it and download or regenerate it.")
    if lens["rewards"] == 0:
        raise DatasetError(f"{path}: the dataset is empty (0 steps)")
    collected = provenance.get("collector") == "envs.collect"
    if collected and "timeouts" not in data:
        raise DatasetError(
            f"{path}: its provenance (attribute {PROVENANCE_ATTR}) says envs.collect made it, which always writes "
            "'timeouts', but the file has none: it was altered after it was written, and its episode ends cannot be "
            "trusted (lost ends would join episodes). Regenerate it with python -m envs.collect")
    if "timeouts" not in data:
        data["timeouts"] = _cut_at_limit(data["terminals"], path, gym_id, max_episode_steps, verbose)
    if recorded is not None and gym_id:
        env_id, found = recorded
        if family_of(env_id) != family_of(gym_id):
            raise DatasetError(
                f"{path} records environment {env_id!r} ({found}), but {name or gym_id} is data of {gym_id}: the file "
                "belongs to another environment, and training on it would be silently wrong even where the dimensions "
                "agree. Put it under its own name, or pick the dataset name that matches it.")
        if found.startswith(f"attribute {PROVENANCE_ATTR}"):
            gym_id = env_id  # a file made by envs.collect says which simulator version it used
    starts, lengths, terminal, keep = split_on_ends(data["terminals"], data["timeouts"], path, max_episode_steps,
                                                    name or gym_id or "the task")
    if collected:
        _check_promise(provenance, len(lengths), lens["rewards"], path)
    return Trajectories(data["observations"][:keep], data["actions"][:keep], data["rewards"][:keep], starts, lengths,
                        terminal, name=name, gym_id=gym_id, source=f"d4rl:{path}", metadata=provenance)


def _check_promise(provenance: dict, episodes: int, steps: int, path: Path) -> None:
    """A collector-made file counts its episodes and steps in its provenance: flags zeroed or added since (one
    surviving terminal joining the rest) make other counts, so the file is refused."""
    promised = {k: provenance.get(k) for k in ("episodes", "steps")}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in promised.values()):
        raise DatasetError(f"{path}: its provenance (attribute {PROVENANCE_ATTR}) says envs.collect made it but does "
                           f"not count its episodes and steps ({promised}); regenerate it with python -m envs.collect")
    if (episodes, steps) != (promised["episodes"], promised["steps"]):
        raise DatasetError(
            f"{path}: its provenance (attribute {PROVENANCE_ATTR}) promises {promised['episodes']:,} episodes in "
            f"{promised['steps']:,} steps, but its terminals and timeouts make {episodes:,} episodes in {steps:,} steps: "
            "its episode-end flags were altered after envs.collect wrote it. Regenerate it with python -m envs.collect")


def _cut_at_limit(terminals: np.ndarray, where: str, gym_id: str | None, limit: int, verbose: bool) -> np.ndarray:
    """Timeouts for a file that records none (D4RL v0): an episode also ends after ``limit`` steps. A file
    of a robot that can fall with no terminal either has lost its episode ends (cutting at the limit would
    join several real episodes into one), so it is refused."""
    term = np.asarray(terminals).reshape(-1).astype(bool)
    family = family_of(gym_id) if gym_id else None
    if not term.any() and family is not None and FAMILIES[family].terminates:
        raise DatasetError(
            f"{where}: records no episode end at all (no 'timeouts' key, and none of its {len(term):,} terminals is "
            f"set), but {gym_id}'s episodes end when the robot falls: its episode boundaries were lost (terminals "
            "zeroed in a conversion?). Use a file with its terminals, or with a 'timeouts' key")
    i = np.arange(len(term))
    first = np.maximum.accumulate(np.where(np.r_[True, term[:-1]], i, 0))  # the row after the last terminal
    timeouts = ((i - first + 1) % limit == 0) & ~term
    if verbose:
        print(f"[envs] note: {where} has no 'timeouts' key: episodes end at a terminal or after {limit} steps "
              f"(the simulator's limit), {int(timeouts.sum())} of them so", file=sys.stderr, flush=True)
    return timeouts


def write_d4rl(path: str | Path, arrays: dict[str, np.ndarray], provenance: dict | None = None) -> Path:
    missing = [k for k in REQUIRED_KEYS + ("timeouts",) if k not in arrays]
    if missing:
        raise ValueError(f"write_d4rl needs arrays {missing}")
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        for key, arr in arrays.items():
            arr = np.asarray(arr)
            arr = arr.astype(bool) if key in ("terminals", "timeouts") else arr.astype(np.float32)
            kw = {"compression": "gzip", "compression_opts": 9, "shuffle": True, "chunks": True} if arr.size else {}
            f.create_dataset(key, data=arr, **kw)
        if provenance is not None:
            f.attrs[PROVENANCE_ATTR] = json.dumps(provenance, sort_keys=True, default=str)
    return write_atomic(path, buf.getbuffer(), "D4RL-layout dataset")
