"""In-memory classification data of every source (UEA, LRA): a split is three aligned tensors, ``x`` (float
[N, T, C] time series, int [N, T] tokens or int [N, 2, T] document pairs), ``mask`` (bool, x's shape without C;
True = real) and ``y`` (int64 [N]). Token id 0 is padding in every token task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


@dataclass
class Split:
    x: torch.Tensor
    mask: torch.Tensor
    y: torch.Tensor

    def __post_init__(self):
        n = self.y.shape[0]
        if self.x.shape[0] != n or self.mask.shape[0] != n:
            raise ValueError(f"split tensors disagree on the number of examples: x {tuple(self.x.shape)}, "
                             f"mask {tuple(self.mask.shape)}, y {tuple(self.y.shape)}")

    def __len__(self) -> int:
        return self.y.shape[0]

    def take(self, idx) -> "Split":
        idx = torch.as_tensor(idx, dtype=torch.long)
        return Split(self.x[idx], self.mask[idx], self.y[idx])


@dataclass
class TaskData:
    """What a classifier needs to know about a task, plus its three splits."""

    name: str
    train: Split
    val: Split | None  # None: no validation split (selection on test, the papers' protocol)
    test: Split
    n_classes: int
    input_kind: str  # "continuous" (x float [.., C]) or "tokens" (x int ids, 0 = padding)
    n_inputs: int  # channels C, or vocabulary size including padding id 0
    max_len: int  # T
    pair: bool = False  # two documents per example (LRA Retrieval)
    class_names: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # provenance and preprocessing, printed and logged

    def describe(self) -> str:
        kind = f"{self.n_inputs} channels" if self.input_kind == "continuous" else f"vocabulary {self.n_inputs}"
        return (f"{self.name}: train {len(self.train)} / val {len(self.val) if self.val else 0} / test {len(self.test)}, "
                f"{self.n_classes} classes, length {self.max_len}, {kind}" + (", document pairs" if self.pair else ""))


def regular_file(path: Path, what: str) -> Path:
    """``path`` if it is a regular file: opening a FIFO waits for a writer forever, a directory fails mid-read."""
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{what} {path} is not a regular file (a directory, FIFO or device); put the file there")
    return path


def carve_validation(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified (fit, val) index split of a training set: each class gives round(fraction * n_c)
    examples (at least one when it has two or more), so small UEA sets keep every class in both."""
    rng = np.random.default_rng(seed)
    fit, val = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = min(max(round(fraction * len(idx)), 1), len(idx) - 1) if len(idx) > 1 else 0
        val.extend(idx[:k])
        fit.extend(idx[k:])
    if not val:
        raise ValueError(f"data.val_fraction={fraction} leaves no validation examples; raise it")
    return np.sort(np.array(fit)), np.sort(np.array(val))


def pad_token_lists(seqs: list[list[int]] | list[np.ndarray], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id sequences (ids >= 1) to ``max_len`` with 0, truncating longer ones."""
    x = torch.zeros(len(seqs), max_len, dtype=torch.int32)
    for i, s in enumerate(seqs):
        s = np.asarray(s[:max_len], dtype=np.int64)
        x[i, : len(s)] = torch.from_numpy(s)
    return x, x != 0


def subset(split: Split, n: int, seed: int) -> Split:
    """At most ``n`` examples drawn at random (n <= 0: all); for fast presets and tests."""
    if n <= 0 or n >= len(split):
        return split
    g = torch.Generator().manual_seed(seed)
    return split.take(torch.randperm(len(split), generator=g)[:n].sort().values)
