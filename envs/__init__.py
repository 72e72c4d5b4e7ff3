"""Simulators and offline data: dataset names, D4RL/Minari loaders, trajectories, segment
sampling, and (``envs.collect``) a collector for new datasets. Independent of the model code."""

from envs.errors import DatasetError, DatasetNotFound
from envs.gl import check_mujoco_gl
from envs.loader import load_dataset
from envs.replica import ReplicaWarning
from envs.registry import EnvSpec, get_spec, list_names, normalized_score
from envs.sampler import SegmentSampler
from envs.trajectories import Trajectories
from envs.vector import make_env, make_vector_env

__all__ = [
    "DatasetError", "DatasetNotFound", "EnvSpec", "ReplicaWarning", "SegmentSampler", "Trajectories",
    "check_mujoco_gl", "get_spec", "list_names", "load_dataset", "make_env", "make_vector_env", "normalized_score",
]
