"""What an HDF5 data file may declare before anything is read from it: a file can declare a dataset of
10**11 rows in a few hundred bytes (HDF5 allocates only on write), and reading it would try to allocate
all of them. Declared sizes are checked against a sane bound and against the file's own size first."""

from __future__ import annotations

import math
from pathlib import Path

from envs.errors import DatasetError

MAX_VALUES = 2**33
"""values one dataset may declare: far above any offline RL dataset (D4RL's largest hold a few 10**7)"""
MAX_RATIO = 1000
"""declared bytes per byte of file: above what compression achieves on recorded data"""


def check_declared_sizes(datasets, path: Path) -> None:
    """Refuse ``datasets`` (h5py datasets of the file at ``path``) whose declared shapes are absurd, before
    any is read: a ``DatasetError`` naming the file, the dataset and its shape."""
    total = 0
    for ds in datasets:
        values = math.prod(ds.shape or ())
        if values > MAX_VALUES:
            raise DatasetError(f"{path}: dataset '{ds.name.lstrip('/')}' declares shape {ds.shape} ({values:.3g} values, "
                               f"more than the {MAX_VALUES:.3g} a dataset may hold); the file is corrupt or not data. "
                               "Regenerate or re-download it")
        total += values * ds.dtype.itemsize
    size = Path(path).stat().st_size
    if total > MAX_RATIO * size + 2**20:
        raise DatasetError(f"{path}: its datasets declare {total:.3g} bytes, but the file holds {size:,} bytes (more "
                           f"than {MAX_RATIO}x what compression reaches); the file is truncated or corrupt. "
                           "Regenerate or re-download it")
