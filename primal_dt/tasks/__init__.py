"""Classification data sources (UEA, LRA; a module each) behind one ``load_task(DataConfig)``, which runs
before training: bad paths and files fail before any compute is spent."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..run.errors import did_you_mean
from ..run.options import AT_LEAST_0, FRACTION, SEED, check_numbers
from .dataset import Split, TaskData, subset
from .listops import ListOpsSpec, write_dataset

SOURCES = ("uea", "listops", "text", "retrieval", "image", "pathfinder")


@dataclass
class DataConfig:
    """Which data a classifier trains on, and how it is split and trimmed."""

    kind: str = "uea"
    """uea | listops | text | retrieval | image | pathfinder (which loader)"""
    name: str = "JapaneseVowels"
    """UEA set name; for pathfinder the difficulty folder (e.g. curv_contour_length_14)"""
    path: str = ""
    """files of the task (LRA release folder; UEA: where non-bundled sets live, default data/uea)"""
    max_len: int = 0
    """sequence length (0: UEA longest training series; LRA the benchmark's length)"""
    val_fraction: float = 0.2
    """share of the training set carved (stratified) for validation where a task has no val split"""
    split_seed: int = 0
    """seed of the validation carve, fixed apart from the training seed so all models share a split"""
    max_train: int = 0
    """keep at most this many training examples (0 = all)"""
    max_val: int = 0
    """keep at most this many validation examples (0 = all)"""
    max_test: int = 0
    """keep at most this many test examples (0 = all)"""
    generate: bool = False
    """ListOps: generate the data (data.listops.*) into data.path, or data/listops/<spec>, if absent"""
    listops: ListOpsSpec = field(default_factory=ListOpsSpec)

    def check(self) -> None:
        if self.kind not in SOURCES:
            hint = did_you_mean(self.kind, SOURCES, n=1)
            raise ValueError(f"data.kind={self.kind!r} is not one of {', '.join(SOURCES)}.{hint}")
        check_numbers(self, {"max_len": AT_LEAST_0, "val_fraction": FRACTION, "split_seed": SEED,
                             "max_train": AT_LEAST_0, "max_val": AT_LEAST_0, "max_test": AT_LEAST_0}, prefix="data.")
        if self.kind == "listops" and self.generate:
            self.listops.check()


def listops_dir(cfg: DataConfig) -> Path:
    """Where ListOps files are read from, generating them first when asked and missing."""
    d = Path(cfg.path) if cfg.path else Path("data/listops") / cfg.listops.tag()
    if not (d / "basic_train.tsv").exists() and cfg.generate:
        print(f"generating ListOps ({cfg.listops.tag()}) into {d} ...", flush=True)
        write_dataset(cfg.listops, d)
    return d


def load_task(cfg: DataConfig, with_val: bool = True) -> TaskData:
    """Load a task; ``with_val=False`` (selection on test, the papers' protocol) fits on the whole
    training set where a validation split would otherwise be carved from it."""
    cfg.check()
    frac = cfg.val_fraction if with_val else 0.0
    if cfg.kind == "uea":
        from .uea import load_uea

        data = load_uea(cfg.name, cfg.path, frac, cfg.split_seed, cfg.max_len)
    else:
        from . import lra

        data = {"listops": lambda: lra.load_listops(str(listops_dir(cfg)), cfg.max_len),
                "text": lambda: lra.load_text(cfg.path, cfg.max_len, frac, cfg.split_seed),
                "retrieval": lambda: lra.load_retrieval(cfg.path, cfg.max_len),
                "image": lambda: lra.load_image(cfg.path, frac, cfg.split_seed),
                "pathfinder": lambda: lra.load_pathfinder(cfg.path, cfg.name)}[cfg.kind]()
    s = cfg.split_seed
    data.train, data.test = subset(data.train, cfg.max_train, s), subset(data.test, cfg.max_test, s)
    data.val = subset(data.val, cfg.max_val, s) if data.val is not None and with_val else None
    return data


__all__ = ["DataConfig", "ListOpsSpec", "SOURCES", "Split", "TaskData", "load_task"]
