"""Replicas: D4RL-format files that ``envs.collect`` generates (or that ship with the package) for a dataset
name, used when the published dataset is not on this machine; every use says loudly that it is one."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from envs import d4rl as d4rl_io
from envs import minari_source
from envs.sources import DatasetNotFound, Request, register
from envs.trajectories import Trajectories

BUNDLED_DIR = Path(__file__).parent / "replicas"


class ReplicaWarning(UserWarning):
    """Training data is a replica, not the published benchmark dataset."""


def replica_dirs() -> list[Path]:
    """Locally generated replicas first ($PRIMAL_DT_DATA_DIR or ~/.primal-dt/datasets), then the bundled ones."""
    local = Path(os.environ.get("PRIMAL_DT_DATA_DIR") or Path.home() / ".primal-dt" / "datasets")
    return [local.expanduser(), BUNDLED_DIR]


def replica_file(family: str, level: str) -> str:
    return f"{family}_{level.replace('-', '_')}-replica.hdf5"


@register("replica", "PATH", "a replica made by envs.collect (without PATH: <family>_<level>-replica.hdf5 in "
          "$PRIMAL_DT_DATA_DIR or ~/.primal-dt/datasets, then the one bundled with the package)")
def read_source(req: Request) -> Trajectories:
    spec = req.spec
    ds = d4rl_io.read_named(req, replica_dirs(), lambda level: replica_file(spec.family, level))
    if ds is None:
        raise DatasetNotFound(f"no {replica_file(spec.family, spec.level)} in {', '.join(map(str, replica_dirs()))}; "
                              f"generate one: python -m envs.collect env={spec.family} level={spec.level}")
    ds.source = "replica:" + ds.source.partition(":")[2]  # read as a D4RL-format file
    prov = ds.metadata or {}
    what = (f"policy step {prov.get('policy_step', '?')}, return {prov.get('policy_return', '?')}"
            if prov else "unknown provenance")
    msg = (f"{spec.name}: using a REPLICA ({ds.source}; {what}), NOT the published D4RL/Minari "
           f"dataset. Scores are not comparable with papers. Put the D4RL file {spec.d4rl_file} in "
           f"{d4rl_io.d4rl_dir()} or a Minari dataset in {minari_source.minari_root()} to use the real one.")
    if req.verbose:  # a command's console: the one loud line, once (a Python warning would add a source line)
        print(f"!! WARNING: {msg}", file=sys.stderr, flush=True)
    else:
        warnings.warn(msg, ReplicaWarning, stacklevel=4)  # at the caller of envs.load_dataset
    return ds
