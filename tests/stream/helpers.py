"""Small real checkpoints in the trainer's format (``primal_dt.train.state``) for agent and evaluator tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from agents import DecisionTransformer, DTConfig
from primal_dt import checkpoint

HOPPER_OBS, HOPPER_ACT = 11, 3


def tiny_model(layout="primal+dt", K=5, options=None, layers=(), seed=0, d_model=32, n_heads=2, n_layers=3):
    torch.manual_seed(seed)
    cfg = DTConfig(HOPPER_OBS, HOPPER_ACT, K=K, d_model=d_model, n_heads=n_heads, n_layers=n_layers, layout=layout,
                   layers=tuple(layers), options=options if options is not None else {"primal": {"s": 8}},
                   dropout=0.0)
    return DecisionTransformer(cfg).eval()


def hopper_stats(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 0.3, HOPPER_OBS).astype(np.float32), rng.uniform(0.5, 2.0, HOPPER_OBS).astype(np.float32))


def checkpoint_dict(model, env="hopper-medium", targets=(3600.0, 1800.0), reward_scale=1000.0, kind="dt"):
    """The keys ``primal_dt.train.state`` writes that inference needs (optimizer etc. left out)."""
    mean, std = hopper_stats()
    return {"kind": kind, "config": {"env": env, "K": model.cfg.K}, "model_config": model.cfg.to_dict(),
            "model": model.state_dict(), "step": 0,
            "data": {"env": env, "gym_id": "Hopper-v4", "source": "test", "state_mean": torch.as_tensor(mean),
                     "state_std": torch.as_tensor(std), "reward_scale": reward_scale, "targets": list(targets),
                     "K": model.cfg.K, "max_timestep": model.cfg.max_timestep}}


def save_checkpoint(tmp: Path, model, **kw) -> Path:
    return checkpoint.save_atomic(checkpoint_dict(model, **kw), Path(tmp) / "last.pt")
