"""Simulators for a dataset name: the Gymnasium MuJoCo env (right version and observation
layout) for evaluation, one at a time or as a vector env for batched rollouts."""

from __future__ import annotations

import warnings

from envs.gl import check_mujoco_gl
from envs.registry import get_spec, sim_kwargs_for


def make_sim(gym_id: str, **kwargs):
    """gym.make with our datasets' observation layout (``sim_kwargs_for``), without the 'v4 is out of date'
    warning (v4 is what D4RL data needs), after ``check_mujoco_gl`` (a bad MUJOCO_GL: one ``ValueError`` line)."""
    import gymnasium as gym

    check_mujoco_gl()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is out of date.*")
        return gym.make(gym_id, **{**sim_kwargs_for(gym_id), **kwargs})


def _gym_id(name: str, gym_id: str | None) -> str:
    spec = get_spec(name)
    gid = gym_id or spec.gym_id
    if gid.split("-v")[0] != spec.gym_id.split("-v")[0]:
        raise ValueError(f"{name} is evaluated in {spec.gym_id.split('-v')[0]}, not {gid}")
    return gid


def make_env(name: str, seed: int | None = 0, gym_id: str | None = None, **make_kwargs):
    """Gymnasium env for ``name`` (D4RL simulator by default; ``gym_id=ds.gym_id`` for data of another
    version, e.g. Minari's v5), reset once with ``seed`` so that plain ``reset()`` calls continue a seeded
    stream."""
    env = make_sim(_gym_id(name, gym_id), **make_kwargs)
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


def make_vector_env(name: str, num_envs: int = 8, seed: int | None = 0, asynchronous: bool = False,
                    gym_id: str | None = None, **vector_kwargs):
    """``num_envs`` copies as a SyncVectorEnv (or AsyncVectorEnv: one process each), env i seeded with
    seed + i; ``vector_kwargs`` go to the vector env (e.g. autoreset_mode)."""
    import gymnasium as gym

    gid = _gym_id(name, gym_id)
    check_mujoco_gl()  # here, before AsyncVectorEnv starts its workers
    cls = gym.vector.AsyncVectorEnv if asynchronous else gym.vector.SyncVectorEnv
    venv = cls([lambda: make_sim(gid) for _ in range(int(num_envs))], **vector_kwargs)
    if seed is not None:
        venv.reset(seed=[seed + i for i in range(int(num_envs))])
        venv.action_space.seed(seed)
    return venv
