"""Dataset names (``hopper-medium``), the simulator each belongs to, and the D4RL scores.

One table keeps every fact about a (family, level) pair, so loaders, collector, trainer and evaluator
cannot disagree about which simulator version goes with which data: D4RL data came from the v3-era
MuJoCo models Gymnasium keeps as v4, Minari's from v5. A Minari dataset id (``mujoco/hopper/medium-v0``,
``primal-dt/hopper/medium-v0``) names a dataset too, when its simulator is one of these families.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from primal_dt.run import json_reader
from primal_dt.run.errors import did_you_mean

LEVELS = ("random", "medium", "medium-replay", "medium-expert", "expert")

# Minari publishes only simple / medium / expert for the MuJoCo locomotion tasks; "simple" is a
# weak trained policy, not D4RL's random one, so random and medium-replay have no Minari source.
_MINARI_LEVELS = {"medium": ("medium",), "expert": ("expert",), "medium-expert": ("medium", "expert")}
MINARI_ID = re.compile(r"(?P<namespace>[\w.-]+(?:/[\w.-]+)*)/(?P<name>[\w.-]+)-v(?P<version>\d+)")
D4RL_REFERENCE = "D4RL's random and expert returns (Fu et al. 2020, v2 datasets)"


@dataclass(frozen=True)
class _Family:
    sim: str  # Gymnasium class name: "Hopper"
    obs_dim: int  # under v4 with the D4RL observation (ant: contact forces included)
    act_dim: int
    minari_obs_dim: int  # under v5 defaults (what Minari recorded)
    ref_min: float  # D4RL random-policy score
    ref_max: float  # D4RL expert score
    targets: tuple[float, ...]  # return-to-go targets of the DT papers
    terminates: bool  # episodes can end before the time limit (the robot falls); halfcheetah's never do
    v4_kwargs: tuple[tuple[str, object], ...] = ()


FAMILIES: dict[str, _Family] = {
    "hopper": _Family("Hopper", 11, 3, 11, -20.272305, 3234.3, (3600.0, 1800.0), True),
    "halfcheetah": _Family("HalfCheetah", 17, 6, 17, -280.178953, 12135.0, (12000.0, 6000.0), False),
    "walker2d": _Family("Walker2d", 17, 6, 17, 1.629008, 4592.3, (5000.0, 2500.0), True),
    # D4RL's ant kept the 84 contact-force entries (obs 111); Gymnasium v4 drops them by default.
    "ant": _Family("Ant", 111, 8, 105, -325.6, 3879.7, (6000.0, 3600.0), True,
                   v4_kwargs=(("use_contact_forces", True),)),
}


@dataclass(frozen=True)
class EnvSpec:
    """Everything the package knows about one dataset name."""

    name: str  # "hopper-medium"
    family: str  # "hopper"
    level: str  # "medium"
    gym_id: str  # simulator of the D4RL data (and of the replicas): "Hopper-v4"
    obs_dim: int
    act_dim: int
    ref_min: float
    ref_max: float
    targets: tuple[float, ...]
    max_episode_steps: int = 1000
    minari_gym_id: str = ""  # simulator of the Minari data: "Hopper-v5"
    minari_obs_dim: int = 0
    minari_ids: tuple[str, ...] = ()  # "mujoco/hopper/medium-v0"; medium-expert joins two
    act_low: float = -1.0  # the simulator's action box, the same in v4 and v5 for every family here
    act_high: float = 1.0  # (the loader refuses data outside it; tests compare it with Gymnasium's)
    ref_source: str = D4RL_REFERENCE  # where ref_min / ref_max come from

    @property
    def simulators(self) -> tuple[str, str]:
        """The simulator ids its data may record: those primal-dt runs (a file naming another is refused when read,
        not when its first evaluation builds the simulator)."""
        sim = FAMILIES[self.family].sim
        return f"{sim}-v4", f"{sim}-v5"

    @property
    def is_minari_id(self) -> bool:
        """The name is a Minari dataset id: Minari is its only source."""
        return "/" in self.name

    @property
    def d4rl_file(self) -> str:
        return f"{self.family}_{self.level.replace('-', '_')}-v2.hdf5"


REGISTRY: dict[str, EnvSpec] = {
    f"{fam}-{level}": EnvSpec(
        name=f"{fam}-{level}", family=fam, level=level, gym_id=f"{f.sim}-v4", obs_dim=f.obs_dim, act_dim=f.act_dim,
        ref_min=f.ref_min, ref_max=f.ref_max, targets=f.targets, minari_gym_id=f"{f.sim}-v5",
        minari_obs_dim=f.minari_obs_dim,
        minari_ids=tuple(f"mujoco/{fam}/{p}-v0" for p in _MINARI_LEVELS.get(level, ())))
    for fam, f in FAMILIES.items() for level in LEVELS}


def minari_root() -> Path:
    """$MINARI_DATASETS_PATH or ~/.minari/datasets (read without creating it, unlike minari)."""
    return Path(os.environ.get("MINARI_DATASETS_PATH") or Path.home() / ".minari" / "datasets").expanduser()


def has_local(dataset_id: str) -> bool:
    return (minari_root() / dataset_id / "data").is_dir()


def local_metadata(dataset_id: str) -> tuple[dict, Path]:
    """(a local dataset's metadata.json, its path); ({}, path) when it is not local or not readable. Here, not in
    envs.minari_source, because a Minari id's spec is read from it and that source module reads the registry."""
    path = minari_root() / dataset_id / "data" / "metadata.json"
    try:
        meta = json_reader.read(path)
    except (OSError, ValueError):
        return {}, path
    return (meta if isinstance(meta, dict) else {}), path


def _minari_spec(dataset_id: str) -> EnvSpec:
    """The spec of a Minari dataset id: its simulator and step limit the local dataset's env spec, else the v5
    simulator of the family its id names; its reference scores its metadata's, else D4RL's."""
    meta, path = local_metadata(dataset_id)
    try:  # (simulator id, episode step limit) the local dataset's env spec records; the limit 1000 if none
        env_spec = json_reader.parse(meta["env_spec"], f"{dataset_id} metadata env_spec")
        recorded = str(env_spec["id"]), int(env_spec.get("max_episode_steps") or 1000)
    except (KeyError, TypeError, ValueError, AttributeError):
        recorded = None
    fam = family_of(recorded[0] if recorded else dataset_id)
    sim, limit = recorded or (f"{FAMILIES[fam].sim}-v5" if fam else None, 1000)
    supported = {f"{f.sim}-v{v}": name for name, f in FAMILIES.items() for v in (4, 5)}
    if sim not in supported:
        what = f"was recorded in {sim}" if recorded else "names no simulator family here (and is not local)"
        raise KeyError(f"Minari dataset {dataset_id!r} {what}; the supported simulators are {', '.join(supported)}")
    f = FAMILIES[fam]
    try:
        ref_min, ref_max = float(meta["ref_min_score"]), float(meta["ref_max_score"])
        ref_source = f"the Minari dataset's metadata (ref_min_score, ref_max_score in {path})"
    except (ValueError, KeyError, TypeError):
        ref_min = ref_max = 0.0
    if not ref_max > ref_min:
        ref_min, ref_max, ref_source = f.ref_min, f.ref_max, (
            f"{D4RL_REFERENCE}: {dataset_id} is not local or its metadata records no ref_min_score / ref_max_score")
    obs = f.obs_dim if sim.endswith("-v4") else f.minari_obs_dim
    return EnvSpec(name=dataset_id, family=fam, level=MINARI_ID.fullmatch(dataset_id)["name"], gym_id=sim,
                   obs_dim=obs, act_dim=f.act_dim, ref_min=ref_min, ref_max=ref_max, targets=f.targets,
                   max_episode_steps=limit, minari_gym_id=sim, minari_obs_dim=obs, minari_ids=(dataset_id,),
                   ref_source=ref_source)


def sim_kwargs_for(gym_id: str) -> dict:
    """gym.make kwargs that give a simulator our datasets' observation layout (Ant-v4: D4RL's contact forces)."""
    return next((dict(f.v4_kwargs) for f in FAMILIES.values() if gym_id == f"{f.sim}-v4"), {})


def family_of(env_id: str) -> str | None:
    """The family an environment or dataset id names, in any of the spellings files record:
    ``Hopper-v4``, ``hopper-medium-v2``, ``mujoco/hopper/medium-v0``, ``half_cheetah`` -> the family;
    None when it names none of ours (``antmaze-umaze-v2`` is not ``ant``)."""
    key = str(env_id).strip().lower().replace("half_cheetah", "halfcheetah").replace("half-cheetah", "halfcheetah")
    for token in re.split(r"[-/_:\s]+", key):
        if token in FAMILIES:
            return token
    return None


def list_names() -> list[str]:
    return sorted(REGISTRY)


def get_spec(name: str) -> EnvSpec:
    """Spec of a dataset name or Minari MuJoCo dataset id; unknown names raise KeyError listing the valid ones."""
    if MINARI_ID.fullmatch(str(name).strip()):
        return _minari_spec(str(name).strip())
    key = str(name).strip().lower().replace("_", "-").removesuffix("-v2")  # D4RL-style "hopper-medium-v2" too
    if key in REGISTRY:
        return REGISTRY[key]
    hint = did_you_mean(key, REGISTRY)
    raise KeyError(f"unknown dataset name {name!r}.{hint} Valid names are <family>-<level> with family in "
                   f"{sorted(FAMILIES)} and level in {list(LEVELS)}: {', '.join(list_names())}; or a Minari dataset "
                   "id of one of these simulators, local or remote (e.g. mujoco/hopper/medium-v0)")


def normalized_score(name: str, returns):
    """Normalized score, 100 * (R - random) / (expert - random) with the spec's reference scores
    (``ref_source`` says whose); float in, float out."""
    spec = get_spec(name)
    r = np.asarray(returns, dtype=np.float64)
    out = 100.0 * (r - spec.ref_min) / (spec.ref_max - spec.ref_min)
    return float(out) if out.ndim == 0 else out
