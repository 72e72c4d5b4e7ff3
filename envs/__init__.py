"""Simulators and offline data: dataset names, D4RL/Minari loaders, trajectories, segment
sampling, and (``envs.collect``) a collector for new datasets. Independent of the model code."""

from envs.gl import check_mujoco_gl
from envs.loader import load_dataset
from envs.registry import EnvSpec, get_spec, list_names, normalized_score
from envs.replica import ReplicaWarning
from envs.sampler import SegmentSampler
from envs.episode_chunks import EpisodeChunks
from envs.sources import DatasetError, DatasetNotFound
from envs.trajectories import Trajectories
from envs.vector import make_env, make_vector_env

__all__ = [
    "DatasetError", "DatasetNotFound", "EnvSpec", "ReplicaWarning", "SegmentSampler", "EpisodeChunks", "Trajectories",
    "check_mujoco_gl", "get_spec", "list_names", "load_dataset", "make_env", "make_vector_env", "normalized_score",
]
