"""UEA multivariate time-series classification archive (.ts files) through ``aeon``.

aeon ships JapaneseVowels and BasicMotions (offline); every other set is read from
``<path>/<Name>/<Name>_{TRAIN,TEST}.ts`` or downloaded there by aeon. Preprocessing follows the papers'
pipeline (mvts-transformer / Flowformer UEA code) with one fix:
- trailing all-NaN steps (how .ts files store unequal lengths) end the series; interior NaNs are linearly
  interpolated per channel; per-channel standardisation with the fitting part of the training set only;
- right-padding to the longest training series, with a mask the model honours at every layer (the reference
  code pads with zeros and lets attention see them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..run.errors import did_you_mean
from .dataset import Split, TaskData, carve_validation, regular_file

BUNDLED = ("BasicMotions", "JapaneseVowels")


def read_split(name: str, split: str, path: str = "") -> tuple[list[np.ndarray], np.ndarray]:
    """Raw series ([C, T_i] float arrays) and string labels of one split."""
    try:
        from aeon.datasets import load_classification
        from aeon.datasets.tsc_datasets import multivariate  # the archive's 30 sets, for did-you-mean hints
    except ImportError as err:  # pragma: no cover - aeon is an optional dependency
        raise RuntimeError("UEA tasks need the 'aeon' package: pip install 'primal-dt[uea]'") from err
    extract = None if name in BUNDLED else (path or "data/uea")
    file = Path(extract or ".") / name / f"{name}_{split.upper()}.ts"
    if extract and file.exists():  # else aeon downloads it
        regular_file(file, "UEA file")
    try:
        X, y = load_classification(name, split=split, extract_path=extract)
    except Exception as err:
        hint = did_you_mean(name, multivariate, n=2) if name not in multivariate else ""
        raise RuntimeError(
            f"UEA set {name!r} could not be loaded ({type(err).__name__}: {err}).{hint} Only "
            f"{' and '.join(BUNDLED)} ship with aeon; for other sets either connect to the network (aeon "
            f"downloads into {extract}/{name}/) or place {name}_TRAIN.ts and {name}_TEST.ts in "
            f"{extract}/{name}/ (set data.path=DIR)."
        ) from err
    series = [np.asarray(s, dtype=np.float64) for s in X]
    where = f"UEA set {name!r} ({file if extract else 'bundled with aeon'})"
    if not series or not all(s.size for s in series):
        raise ValueError(f"{where}: its {split} split holds no series, or an empty one; replace the file with the "
                         "archive's")
    if any(np.isinf(s).any() for s in series):
        raise ValueError(f"{where}: its {split} split holds infinite values (.ts files mark a missing one with NaN)")
    return series, np.asarray(y).astype(str)


def clean_series(s: np.ndarray) -> np.ndarray:
    """[C, T] with NaNs -> [T', C]: drop trailing all-NaN steps, interpolate the rest per channel.
    A channel with no observation at all stays NaN here and becomes 0 (its mean) after scaling."""
    s = s.T  # [T, C]
    observed = ~np.isnan(s).all(axis=1)
    last = int(np.flatnonzero(observed)[-1]) + 1 if observed.any() else 1
    s = s[:last].copy()
    t = np.arange(last)
    for c in range(s.shape[1]):
        bad = np.isnan(s[:, c])
        if bad.any() and not bad.all():
            s[bad, c] = np.interp(t[bad], t[~bad], s[~bad, c])
    return s


def load_uea(name: str, path: str = "", val_fraction: float = 0.2, split_seed: int = 0,
             max_len: int = 0) -> TaskData:
    """One UEA set, cleaned, standardised and padded (``val_fraction=0``: all training series fit)."""
    (raw_train, y_train), (raw_test, y_test) = read_split(name, "train", path), read_split(name, "test", path)
    train, test = [clean_series(s) for s in raw_train], [clean_series(s) for s in raw_test]
    classes = sorted(set(y_train))
    unknown = sorted(map(str, set(y_test) - set(classes)))
    if unknown:
        raise ValueError(f"UEA set {name!r}: test labels {unknown} never occur in the training split")
    channels = sorted({len(s) for s in raw_train + raw_test})
    if len(channels) > 1 or len(classes) < 2:  # a mismatch would broadcast against the training statistics
        raise ValueError(f"UEA set {name!r}: its series have {' and '.join(map(str, channels))} channels and its "
                         f"training split {len(classes)} class(es); a classifier needs one channel count and >= 2 classes")
    yt, ys = np.searchsorted(classes, y_train), np.searchsorted(classes, y_test)  # class indices

    if val_fraction > 0:
        fit_idx, val_idx = carve_validation(yt, val_fraction, split_seed)
    else:
        fit_idx, val_idx = np.arange(len(train)), np.array([], dtype=int)
    fit_rows = np.concatenate([train[i] for i in fit_idx])
    mean, std = np.nan_to_num(np.nanmean(fit_rows, axis=0)), np.nanstd(fit_rows, axis=0)
    std = np.where(np.isfinite(std) & (std > 1e-8), std, 1.0)

    T = max_len or max(len(s) for s in train)
    notes = [f"UEA {name} via aeon ({'bundled' if name in BUNDLED else 'from ' + (path or 'data/uea')}); "
             f"standardised with statistics of {len(fit_idx)} fitting series; padded to {T}"]
    cut_train, cut_test = sum(len(s) > T for s in train), sum(len(s) > T for s in test)
    if cut_train or cut_test:
        notes.append(f"truncated to {T}: {cut_train} training and {cut_test} test series (the reference code pads "
                     f"to the longest of train and test, {max(len(s) for s in train + test)}: data.max_len=N)")

    def split(series, labels, idx):
        x, m = torch.zeros(len(idx), T, mean.shape[0]), torch.zeros(len(idx), T, dtype=torch.bool)
        for row, i in enumerate(idx):
            z = np.nan_to_num((series[i][:T] - mean) / std, nan=0.0)
            x[row, : len(z)], m[row, : len(z)] = torch.from_numpy(z).float(), True
        return Split(x, m, torch.as_tensor(labels[idx], dtype=torch.long))

    return TaskData(name=f"uea/{name}", train=split(train, yt, fit_idx),
                    val=split(train, yt, val_idx) if len(val_idx) else None, test=split(test, ys, np.arange(len(test))),
                    n_classes=len(classes), input_kind="continuous", n_inputs=int(mean.shape[0]), max_len=T,
                    class_names=classes, notes=notes)
