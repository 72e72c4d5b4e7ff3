"""Minari datasets: read local ones, download (failing fast when offline), write new ones.

Minari stores T+1 observations per T actions; we keep the first T (the state each action was taken in),
and an episode that neither terminated nor was truncated is an unfinished fragment, as in D4RL files.
The recorded simulator must be the name's, so a walker2d dataset filed under hopper is refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import warnings
from pathlib import Path
from unittest import mock
from urllib.parse import urlparse

import h5py
import numpy as np

from envs.d4rl import check_declared_sizes, parse_provenance
from envs.download import reachable
from envs.registry import family_of, has_local, local_metadata, minari_root
from envs.sources import DatasetError, DatasetNotFound, Request, register
from envs.trajectories import Trajectories
from primal_dt.run import json_reader

COLLECTED_NAMESPACE = "primal-dt"  # where envs.collect files its datasets


@register("minari", "ID", "a Minari dataset id, local (in $MINARI_DATASETS_PATH or ~/.minari/datasets) or downloaded "
          "(without ID: Minari's dataset of the name)", label="Minari {where}")
def read_source(req: Request) -> Trajectories:
    spec = req.spec
    ids = (req.where,) if req.where else spec.minari_ids
    if not ids:
        raise DatasetNotFound(f"Minari publishes no {spec.level} dataset for {spec.family} (only medium, expert and "
                              "their union)")
    for i in (i for i in ids if not has_local(i)):
        if not req.download:
            raise DatasetNotFound(f"no local {i} under {minari_root()}; `minari download {i}` on a connected "
                                  f"machine and copy it there ($MINARI_DATASETS_PATH), or allow the download "
                                  "(unset PRIMAL_DT_OFFLINE)")
        download_minari(i)
    # the family must match; dims are checked against the simulator the dataset records
    sub = [read_minari(i, spec.name, spec.minari_gym_id, spec.max_episode_steps) for i in ids]
    return Trajectories.concat(sub, name=spec.name, gym_id=sub[0].gym_id, source="minari:" + "+".join(ids))


def read_minari(dataset_id: str, name: str | None = None, gym_id: str | None = None,
                max_episode_steps: int = 1000) -> Trajectories:
    """Episodes of a local Minari dataset; ``gym_id`` is the simulator it must come from. Episode ends cannot
    vanish: only the last episode may lack an end flag (a collection stopped mid-episode), and none may be longer
    than the simulator's step limit (the one the dataset records, else ``max_episode_steps``)."""
    where = f"Minari dataset {dataset_id} at {minari_root() / dataset_id}"
    if not has_local(dataset_id):
        raise DatasetNotFound(f"no local Minari dataset {dataset_id} under {minari_root()}")
    _check_layout(dataset_id, where)
    import minari

    try:
        ds = minari.load_dataset(dataset_id)
    except Exception as exc:  # minari raises many types for broken metadata / h5 files
        raise DatasetError(f"{where} cannot be opened ({type(exc).__name__}: {exc}); delete the "
                           "folder and download or regenerate it") from exc
    env_spec = ds.spec.env_spec
    recorded = getattr(env_spec, "id", None)
    limit = getattr(env_spec, "max_episode_steps", None) or max_episode_steps
    if gym_id is not None:
        if recorded is None:
            warnings.warn(f"{where} records no simulator; assuming {gym_id}", stacklevel=2)
        elif family_of(recorded) != family_of(gym_id):
            raise DatasetError(f"{where} was recorded in {recorded}, but {name or gym_id} needs {gym_id}; it is a "
                               "dataset for another environment (its env spec says so). Move it away or pick the "
                               "matching name.")
    if not hasattr(ds.observation_space, "shape") or ds.observation_space.shape is None:
        raise DatasetError(f"{where}: observations of type {ds.observation_space} are not flat arrays")
    try:
        raw = list(ds.iterate_episodes())
    except (OSError, KeyError, ValueError, RuntimeError) as exc:  # RuntimeError: h5py's, for a link to itself
        raise DatasetError(f"{where}: episodes cannot be read ({exc}); the files are corrupt") from exc
    for ep in raw:
        if len(ep.rewards) > limit:
            raise DatasetError(f"{where}: episode {ep.id} is {len(ep.rewards)} steps long, more than "
                               f"{recorded or gym_id}'s limit of {limit} steps per episode, so its end flags "
                               "cannot be right (episodes joined?). Regenerate or re-download it")
    ended = [len(ep.rewards) > 0 and bool(ep.terminations[-1] or ep.truncations[-1]) for ep in raw]
    lost = [ep.id for ep, end in zip(raw[:-1], ended) if not end]
    if lost:
        ids = ", ".join(map(str, lost[:5])) + (", ..." if len(lost) > 5 else "")
        raise DatasetError(f"{where}: {len(lost)} of its {len(raw)} episodes (ids {ids}) end with neither a "
                           "termination nor a truncation; only the last may be unfinished, so their episode ends were "
                           "lost (flags zeroed?). Regenerate or re-download it")
    episodes = [{"observations": np.asarray(ep.observations)[: len(ep.rewards)], "actions": np.asarray(ep.actions),
                 "rewards": np.asarray(ep.rewards), "terminal": bool(ep.terminations[-1])}
                for ep, end in zip(raw, ended) if end]
    if not episodes:
        raise DatasetError(f"{where}: holds no complete episode ({ds.total_episodes} episodes, {ds.total_steps} steps)")
    meta = {k: v for k, v in ds.storage.metadata.items() if isinstance(v, (str, int, float, list, dict))}
    meta.update(parse_provenance(meta.pop("primal_dt", "{}"), f"{where} metadata primal_dt"))
    return Trajectories.from_episodes(episodes, name=name, gym_id=recorded or gym_id,
                                      source=f"minari:{dataset_id}", metadata=meta)


def _check_layout(dataset_id: str, where: str) -> None:
    """Before minari reads anything: the episode groups are as many as the metadata counts (minari reads
    only as many as it counts, so others would vanish silently), and no array declares an absurd size."""
    meta = local_metadata(dataset_id)[0]
    files = sorted((minari_root() / dataset_id / "data").glob("*.hdf5"))
    for f_path in files:
        if not f_path.is_file():  # opening a FIFO waits for a writer: forever
            raise DatasetError(f"{where}: {f_path.name} is not a regular file (a FIFO, socket, device or directory); "
                               "delete the folder and download or regenerate it")
        try:
            with h5py.File(f_path, "r") as f:
                arrays = []
                f.visititems(lambda _, obj: arrays.append(obj) if isinstance(obj, h5py.Dataset) else None)
                check_declared_sizes(arrays, f_path)
                groups = sum(1 for k in f if k.startswith("episode_"))
        except OSError as exc:
            raise DatasetError(f"{where}: {f_path.name} is not a readable HDF5 file ({exc}); delete the folder and "
                               "download or regenerate it") from exc
        counted = meta.get("total_episodes")
        if isinstance(counted, int) and counted != groups and len(files) == 1:
            raise DatasetError(f"{where}: its metadata counts {counted} episodes but {f_path.name} holds {groups} "
                               "episode groups; the dataset is incomplete or its metadata wrong. Regenerate or "
                               "re-download it")


def download_minari(dataset_id: str, timeout: float = 5.0) -> None:
    """Download with minari, after a reachability probe: an offline machine gets a clear error in seconds,
    not a hang."""
    hf = os.environ.get("MINARI_REMOTE", "hf://farama-minari").startswith("hf://")
    if hf and importlib.util.find_spec("huggingface_hub") is None:
        raise DatasetNotFound(f"downloading {dataset_id} needs huggingface_hub, which the download extra installs: "
                              "pip install 'primal-dt[download]' (in a checkout: pip install -e '.[download]')")
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co") if hf else "https://storage.googleapis.com")
    port = url.port or (443 if url.scheme == "https" else 80)
    reason = reachable(url.hostname or "", port, timeout)
    if reason is not None:
        raise DatasetNotFound(f"cannot download Minari dataset {dataset_id}: {url.hostname}:{port} is unreachable "
                              f"({reason}). This machine is offline; copy the dataset into {minari_root()} "
                              f"(`minari download {dataset_id}` on a connected machine) or use another source.")
    import minari

    try:
        minari.download_dataset(dataset_id)
    except Exception as exc:
        raise DatasetNotFound(f"download of Minari dataset {dataset_id} failed: {type(exc).__name__}: {exc}") from exc


def write_minari(dataset_id: str, episodes: list[dict], env_id: str, *, metadata: dict | None = None,
                 ref_min_score: float | None = None, ref_max_score: float | None = None,
                 description: str = "", overwrite: bool = False) -> Path:
    """Create a Minari dataset, built in a hidden folder of the Minari root and renamed into place (a crash
    leaves no half dataset). ``episodes``: observations [T+1] (final state included), actions, rewards,
    terminations, truncations [T], optionally seed; ``metadata`` (provenance) goes to its metadata.json."""
    import minari
    from minari.data_collector import EpisodeBuffer

    from envs.vector import make_sim

    root = minari_root()
    final = root / dataset_id
    if (final / "data").exists() and not overwrite:
        raise FileExistsError(f"Minari dataset {dataset_id} already exists at {final}; pass "
                              "overwrite=True (collect: overwrite=True) to replace it")
    root.mkdir(parents=True, exist_ok=True)
    tmp_root = root / f".tmp-{os.getpid()}-{dataset_id.replace('/', '_')}"
    shutil.rmtree(tmp_root, ignore_errors=True)
    buffers = [EpisodeBuffer(id=i, seed=ep.get("seed"), observations=np.asarray(ep["observations"], np.float32),
                             actions=np.asarray(ep["actions"], np.float32), rewards=np.asarray(ep["rewards"], np.float64),
                             terminations=np.asarray(ep["terminations"], bool),
                             truncations=np.asarray(ep["truncations"], bool)) for i, ep in enumerate(episodes)]
    env = make_sim(env_id)
    try:
        with mock.patch.dict(os.environ, MINARI_DATASETS_PATH=str(tmp_root)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = minari.create_dataset_from_buffers(
                dataset_id, buffers, env=env, algorithm_name="SAC (stable-baselines3)", author="primal-dt envs.collect",
                author_email="n/a", code_permalink="envs/collect.py (primal-dt)", description=description,
                ref_min_score=ref_min_score, ref_max_score=ref_max_score)
            if metadata:
                ds.storage.update_metadata({"primal_dt": json.dumps(metadata, sort_keys=True, default=str)})
        # namespace metadata files first (harmless if they exist), then the dataset in one rename
        for ns in Path(dataset_id).parents[:-1]:
            src, dst = tmp_root / ns / "namespace_metadata.json", root / ns / "namespace_metadata.json"
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.exists() and not dst.exists():
                shutil.copy2(src, dst)
        old = final.with_name(f".old-{os.getpid()}-{final.name}")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp_root / dataset_id, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        env.close()
        shutil.rmtree(tmp_root, ignore_errors=True)
    return final
