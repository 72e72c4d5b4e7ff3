"""``load_dataset(name)``: find a dataset for a name, trying sources in a fixed order.

Order: a local D4RL file, a local Minari dataset, a Minari download, then a replica (generated
locally by ``envs.collect`` or bundled with the package). A source that has nothing moves the
search on; a source that has something broken stops it with the reason, because quietly falling
back to other data would make results incomparable. The chosen source is printed and stored in
``ds.source`` so runs record what they trained on (``ds.fingerprint`` records its content).

Whatever the source, actions must lie in the simulator's action box: data outside it (recorded
unscaled, or another task's) is refused with the count and the range, unless the caller asks to
clip it (``clip_actions=True``; ``primal_dt.train``'s ``data_clip_actions=true``).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from envs import d4rl as d4rl_io
from envs import minari_source
from envs.errors import DatasetError, DatasetNotFound
from envs.registry import EnvSpec, get_spec
from envs.trajectories import Trajectories

SOURCES = ("auto", "d4rl", "minari", "replica")
BUNDLED_DIR = Path(__file__).parent / "replicas"


class ReplicaWarning(UserWarning):
    """Training data is a replica, not the published benchmark dataset."""


def replica_dirs() -> list[Path]:
    """Locally generated replicas first ($PRIMAL_DT_DATA_DIR or ~/.primal-dt/datasets), then the
    ones shipped inside the package."""
    local = Path(os.environ.get("PRIMAL_DT_DATA_DIR") or Path.home() / ".primal-dt" / "datasets")
    return [local.expanduser(), BUNDLED_DIR]


def replica_file(family: str, level: str) -> str:
    return f"{family}_{level.replace('-', '_')}-replica.hdf5"


def _with(ds: Trajectories, spec: EnvSpec, source: str) -> Trajectories:
    ds.name, ds.source = spec.name, source
    return ds


def _from_d4rl(spec: EnvSpec) -> Trajectories:
    root = d4rl_io.d4rl_dir()
    path = root / spec.d4rl_file
    if path.exists() or spec.level != "medium-expert":
        if not path.exists():
            raise DatasetNotFound(f"d4rl: no {path}")
        return d4rl_io.read_d4rl(path, spec.name, spec.gym_id, spec.max_episode_steps)
    parts = [get_spec(f"{spec.family}-{lv}") for lv in ("medium", "expert")]
    paths = [root / p.d4rl_file for p in parts]
    if not all(p.exists() for p in paths):
        raise DatasetNotFound(f"d4rl: no {path} (nor both {paths[0].name} and {paths[1].name})")
    sub = [d4rl_io.read_d4rl(p, spec.name, spec.gym_id, spec.max_episode_steps) for p in paths]
    return Trajectories.concat(sub, name=spec.name, gym_id=spec.gym_id,
                               source="d4rl:" + "+".join(map(str, paths)))


def _from_minari(spec: EnvSpec, download: bool) -> Trajectories:
    if not spec.minari_ids:
        raise DatasetNotFound(f"minari: Minari publishes no {spec.level} dataset for {spec.family} "
                              "(only medium, expert and their union)")
    missing = [i for i in spec.minari_ids if not minari_source.has_local(i)]
    if missing and not download:
        raise DatasetNotFound(f"minari: no local {', '.join(missing)} under {minari_source.minari_root()}")
    for i in missing:
        try:
            minari_source.download_minari(i)
        except DatasetNotFound as exc:
            raise DatasetNotFound(f"minari: no local {i} under {minari_source.minari_root()}; "
                                  f"download failed: {exc}") from exc
    sub = [minari_source.read_minari(i, spec.name, spec.minari_gym_id) for i in spec.minari_ids]
    if len(sub) == 1:
        return sub[0]
    return Trajectories.concat(sub, name=spec.name, gym_id=sub[0].gym_id,
                               source="minari:" + "+".join(spec.minari_ids))


def _from_replica(spec: EnvSpec) -> Trajectories:
    for d in replica_dirs():
        path = d / replica_file(spec.family, spec.level)
        if path.exists():
            ds = d4rl_io.read_d4rl(path, spec.name, spec.gym_id, spec.max_episode_steps)
            ds.source = f"replica:{path}"
            return ds
        if spec.level == "medium-expert":
            paths = [d / replica_file(spec.family, lv) for lv in ("medium", "expert")]
            if all(p.exists() for p in paths):
                sub = [d4rl_io.read_d4rl(p, spec.name, spec.gym_id, spec.max_episode_steps) for p in paths]
                return Trajectories.concat(sub, name=spec.name, gym_id=spec.gym_id,
                                           source="replica:" + "+".join(map(str, paths)),
                                           metadata=sub[0].metadata)
    raise DatasetNotFound(
        f"replica: no {replica_file(spec.family, spec.level)} in {', '.join(map(str, replica_dirs()))}"
    )


def _announce_replica(ds: Trajectories, spec: EnvSpec, verbose: bool) -> None:
    prov = ds.metadata or {}
    what = (f"policy step {prov.get('policy_step', '?')}, return {prov.get('policy_return', '?')}"
            if prov else "unknown provenance")
    msg = (f"{spec.name}: using a REPLICA ({ds.source}; {what}), NOT the published D4RL/Minari "
           f"dataset. Scores are not comparable with papers. Put the D4RL file {spec.d4rl_file} in "
           f"{d4rl_io.d4rl_dir()} or a Minari dataset in {minari_source.minari_root()} to use the real one.")
    warnings.warn(msg, ReplicaWarning, stacklevel=4)  # points at the caller of load_dataset
    if verbose:
        bar = "!" * 100
        print(f"{bar}\n!! WARNING: {msg}\n{bar}", file=sys.stderr, flush=True)


def load_dataset(name: str, source: str = "auto", verbose: bool = True,
                 download: bool | None = None, clip_actions: bool = False) -> Trajectories:
    """Trajectories for a dataset name such as ``hopper-medium``.

    source: "auto" (D4RL file, local Minari, Minari download, replica), "d4rl", "minari" (local,
    then download), "replica", or an explicit "d4rl:/path/file.hdf5" / "minari:namespace/id-v0".
    download: allow the Minari download step (default: yes, unless $PRIMAL_DT_OFFLINE=1).
    clip_actions: clip actions outside the simulator's action box into it (default: such data is a
    ``DatasetError`` giving how many values lie outside and their range).
    """
    spec = get_spec(name)
    if download is None:
        download = os.environ.get("PRIMAL_DT_OFFLINE", "") not in ("1", "true", "yes")
    if source.startswith("d4rl:"):
        path = Path(source[5:]).expanduser()
        if not path.exists():
            raise DatasetError(f"no file at {path} (asked for by source={source!r})")
        ds = _with(d4rl_io.read_d4rl(path, spec.name, spec.gym_id, spec.max_episode_steps), spec,
                   f"d4rl:{path}")
        return _report(ds, spec, verbose, [], clip_actions)
    if source.startswith("minari:"):
        dsid = source[7:]
        if not minari_source.has_local(dsid):
            if not download:
                raise DatasetError(f"no local Minari dataset {dsid} under {minari_source.minari_root()}")
            minari_source.download_minari(dsid)
        # the family must match; dims are checked against the simulator the dataset records
        ds = minari_source.read_minari(dsid, spec.name, spec.minari_gym_id)
        return _report(ds, spec, verbose, [], clip_actions)
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES} or 'd4rl:PATH' / 'minari:ID', got {source!r}")
    if spec.is_minari_id:
        return _minari_id(spec, source, download, verbose, clip_actions)
    steps = {
        "d4rl": [lambda: _from_d4rl(spec)],
        "minari": [lambda: _from_minari(spec, download)],
        "replica": [lambda: _from_replica(spec)],
    }
    order = steps["d4rl"] + steps["minari"] + steps["replica"] if source == "auto" else steps[source]
    notes: list[str] = []
    for attempt in order:
        try:
            ds = attempt()
        except DatasetNotFound as exc:
            notes.append(str(exc))
            if verbose and source == "auto":
                print(f"[envs] {spec.name}: {exc}", file=sys.stderr, flush=True)
            continue
        ds.name = spec.name
        return _report(ds, spec, verbose, notes, clip_actions)
    raise DatasetNotFound(
        f"no dataset for {spec.name} (source={source!r}). Looked at:\n  - " + "\n  - ".join(notes)
        + f"\nTo fix: put the D4RL file {spec.d4rl_file} in {d4rl_io.d4rl_dir()} ($D4RL_DATASET_DIR), "
        f"or a Minari dataset in {minari_source.minari_root()} ($MINARI_DATASETS_PATH), or generate a "
        f"replica: python -m envs.collect env={spec.family} level={spec.level}"
    )


def _minari_id(spec: EnvSpec, source: str, download: bool, verbose: bool, clip_actions: bool) -> Trajectories:
    """A Minari dataset named by its id: Minari (local, then a download) is its only source."""
    if source not in ("auto", "minari"):
        raise DatasetError(f"env={spec.name} names a Minari dataset; source={source!r} cannot provide it "
                           "(use source auto or minari, or a D4RL name such as "
                           f"{spec.family}-{spec.level} for D4RL files and replicas)")
    try:
        ds = _from_minari(spec, download)
    except DatasetNotFound as exc:
        raise DatasetNotFound(
            f"no dataset for {spec.name}: {exc}. To fix: `minari download {spec.name}` on a connected machine and "
            f"copy it into {minari_source.minari_root()} ($MINARI_DATASETS_PATH)"
            + ("" if download else ", or allow the download (unset PRIMAL_DT_OFFLINE)")) from exc
    return _report(ds, get_spec(spec.name), verbose, [], clip_actions)  # its metadata's scores, now it is local


def check_actions(ds: Trajectories, spec: EnvSpec, clip: bool = False, verbose: bool = True) -> None:
    """Refuse (or, with ``clip``, clip) actions outside the simulator's action box. The simulator
    clips what it is given and the model's tanh head cannot produce such values, so training on
    them silently teaches something no agent can do."""
    low, high = spec.act_low, spec.act_high
    outside = (ds.actions < low) | (ds.actions > high)
    n = int(outside.sum())
    if n == 0:
        return
    sim = ds.gym_id or spec.gym_id
    rows = int(outside.any(axis=1).sum())
    values = ds.actions[outside]
    what = (f"{n:,} of {ds.actions.size:,} action values ({rows:,} of {ds.num_steps:,} steps) lie outside {sim}'s "
            f"action space [{low:g}, {high:g}]; they range over [{values.min():.4g}, {values.max():.4g}]")
    if not clip:
        raise DatasetError(
            f"{ds.source}: {what}. The simulator clips actions to its box and the model's tanh head cannot produce "
            "them, so training on them would be silently wrong. Check how the file stores actions (unscaled? "
            "another environment's?), or train on them clipped into the box: data_clip_actions=true "
            "(python -m primal_dt.train), clip_actions=True (envs.load_dataset)")
    ds.clip_actions(low, high)
    ds.metadata = {**(ds.metadata or {}), "clipped_actions": n}
    if verbose:
        print(f"[envs] {spec.name}: {what}: clipped into the box as asked (clip_actions)", file=sys.stderr, flush=True)


def _report(ds: Trajectories, spec: EnvSpec, verbose: bool, notes: list[str], clip_actions: bool) -> Trajectories:
    check_actions(ds, spec, clip_actions, verbose)
    ds.metadata = dict(ds.metadata or {})
    if notes:
        ds.metadata["searched"] = notes
    if ds.source.startswith("replica:"):
        _announce_replica(ds, spec, verbose)
    elif ds.metadata.get("collector") and verbose:
        print(f"[envs] note: {ds.source} was made by envs.collect, not a published dataset",
              file=sys.stderr, flush=True)
    if verbose:
        print(f"[envs] {spec.name}: source {ds.source} -- {ds.summary()}", flush=True)
        print(f"[envs] {spec.name}: normalized scores use random {spec.ref_min:g} and expert {spec.ref_max:g} "
              f"returns, from {spec.ref_source}", flush=True)
    return ds
