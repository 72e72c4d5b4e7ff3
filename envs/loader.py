"""``load_dataset(name)``: the data of a dataset name, searched in ``envs.sources``, and what every
source's data must pass. The chosen source is printed and kept in ``ds.source``, so runs record it."""

from __future__ import annotations

import os
import sys

from envs import sources
from envs.registry import EnvSpec, get_spec
from envs.trajectories import Trajectories


def load_dataset(name: str, source: str = "auto", verbose: bool = True,
                 download: bool | None = None, clip_actions: bool = False) -> Trajectories:
    """Trajectories for a dataset name (``hopper-medium``) or a Minari dataset id, from ``source`` (what
    ``envs.sources.help_text()`` lists). ``download`` (default: unless $PRIMAL_DT_OFFLINE=1) allows D4RL's
    and Minari's downloads; ``clip_actions`` clips actions outside the simulator's box, which are refused otherwise."""
    spec = get_spec(name)
    if download is None:
        download = os.environ.get("PRIMAL_DT_OFFLINE", "") not in ("1", "true", "yes")
    chosen, where = sources.parse(source)
    notes: list[str] = []
    for src in [chosen] if chosen else sources.order(spec):
        try:
            ds = sources.read(src, sources.Request(spec, where, download, verbose))
            break
        except sources.DatasetNotFound as exc:
            if where:  # a place named by the user: nothing there is an error, not a search
                raise sources.DatasetError(f"{exc} (asked for by data_source={source!r})") from exc
            notes.append(f"{src.prefix}: {exc}")  # kept in ds.metadata["searched"]
    else:
        raise sources.DatasetNotFound(f"no dataset for {spec.name} (data_source={source!r}). Looked at:\n  - "
                                      + "\n  - ".join(notes))
    ds.name = spec.name
    if spec.is_minari_id:
        spec = get_spec(spec.name)  # its metadata's scores, now it is local
    check_actions(ds, spec, clip_actions, verbose)
    ds.metadata = dict(ds.metadata or {})
    if notes:
        ds.metadata["searched"] = notes
    if ds.metadata.get("collector") and verbose and not ds.source.startswith("replica:"):
        print(f"[envs] note: {ds.source} was made by envs.collect, not a published dataset",
              file=sys.stderr, flush=True)
    if verbose:
        print(f"[envs] {spec.name}: source {ds.source} -- {ds.summary()}", flush=True)
        print(f"[envs] {spec.name}: normalized scores use random {spec.ref_min:g} and expert {spec.ref_max:g} "
              f"returns, from {spec.ref_source}", flush=True)
    return ds


def check_actions(ds: Trajectories, spec: EnvSpec, clip: bool = False, verbose: bool = True) -> None:
    """Refuse (or, with ``clip``, clip) actions outside the simulator's action box (recorded unscaled, or
    another task's): the simulator clips them and the model's tanh head cannot produce them."""
    low, high = spec.act_low, spec.act_high
    outside = (ds.actions < low) | (ds.actions > high)
    if not (n := int(outside.sum())):
        return
    rows, values = int(outside.any(axis=1).sum()), ds.actions[outside]
    what = (f"{n:,} of {ds.actions.size:,} action values ({rows:,} of {ds.num_steps:,} steps) lie outside "
            f"{ds.gym_id or spec.gym_id}'s action space [{low:g}, {high:g}]; they range over "
            f"[{values.min():.4g}, {values.max():.4g}]")
    if not clip:
        raise sources.DatasetError(
            f"{ds.source}: {what}. The simulator clips actions to its box and the model's tanh head cannot produce "
            "them, so training on them would be silently wrong. Check how the file stores actions (unscaled? "
            "another environment's?), or train on them clipped into the box: data_clip_actions=true "
            "(python -m primal_dt.train), clip_actions=True (envs.load_dataset)")
    ds.clip_actions(low, high)
    ds.metadata = {**(ds.metadata or {}), "clipped_actions": n}
    if verbose:
        print(f"[envs] {spec.name}: {what}: clipped into the box as asked (clip_actions)", file=sys.stderr, flush=True)

