"""Checkpoints written atomically (temp file + rename), so a crash never leaves a torn file.

A checkpoint is a dict saved with torch.save; by convention it holds
  kind   "dt" | "classifier" | ...  (what builds the model back)
  config the run's config as a plain dict
  model  the model state_dict
plus whatever the trainer needs to resume (optimizer, scheduler, RNG states, step, ...).
This module only writes and reads files; the layout of a DT checkpoint is ``agents.dt_checkpoint``'s
(its one writer and reader), a classifier's is ``primal_dt.classifier_training``'s.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


def save_atomic(obj, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(path: str | Path, expect_kind: str | None = None) -> dict:
    """Load a checkpoint with a clear error for a missing, corrupt or foreign file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many kinds for a corrupt file
        raise ValueError(f"checkpoint {path} could not be read ({type(err).__name__}: {err}); "
                         "it may be truncated or not a primal-dt checkpoint") from err
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise ValueError(f"{path} is not a primal-dt checkpoint (expected a dict with 'model' and 'config')")
    if expect_kind is not None and ckpt.get("kind") != expect_kind:
        raise ValueError(f"checkpoint {path} holds a {ckpt.get('kind')!r} model, expected {expect_kind!r}")
    return ckpt
