"""Long-Range Arena (Tay et al. 2021) tasks read from the files the benchmark is built from.

- ListOps: the release's ``basic_{train,val,test}.tsv`` (listops.py).
- Text: IMDB reviews as bytes, from the ``aclImdb`` layout ({train,test}/{pos,neg}/*.txt); validation carved.
- Retrieval: the release's ``new_aan_pairs.{train,eval,test}.tsv`` (label, id1, id2, text1, text2; no header).
- Image: CIFAR-10 python batches turned grey (0.2989 R + 0.5870 G + 0.1140 B, as tf.image.rgb_to_grayscale),
  1024 pixel tokens.
- Pathfinder: the release's ``pathfinder32/<difficulty>/`` (``metadata/*.npy`` text lines ``imgs/<k>
  sample_<n>.png <..> <label>``, 32x32 PNGs); metadata files in sorted order cut 80 / 10 / 10.
Byte and pixel tokens are value + 1, so id 0 stays padding.
"""

from __future__ import annotations

import csv
import importlib
import pickle
from pathlib import Path

import numpy as np
import torch

from . import listops
from .dataset import Split, TaskData, carve_validation, pad_token_lists, regular_file

# LRA's sequence lengths (per document for Retrieval).
DEFAULT_LEN = {"listops": 2000, "text": 4000, "retrieval": 4000, "image": 1024, "pathfinder": 1024}


def _need_dir(path: str, what: str, hint: str) -> Path:
    if not path or not Path(path).is_dir():
        raise FileNotFoundError(f"{what}: directory {path!r} does not exist; set data.path to {hint}")
    return Path(path)


def _split(seqs, labels, max_len) -> Split:
    x, m = pad_token_lists(seqs, max_len)
    return Split(x, m, torch.as_tensor(labels, dtype=torch.long))


def _carved(name, full: Split, test, val_fraction, split_seed, **kw) -> TaskData:
    """TaskData from a training set without a validation split (carved unless val_fraction == 0)."""
    val = None
    if val_fraction > 0:
        fit, val = carve_validation(full.y.numpy(), val_fraction, split_seed)
        full, val = full.take(fit), full.take(val)
    return TaskData(name=name, train=full, val=val, test=test, input_kind="tokens", **kw)


def bytes_ids(text: str) -> list[int]:
    return [b + 1 for b in text.encode("utf-8")]


def load_listops(path: str, max_len: int = 0) -> TaskData:
    root = _need_dir(path, "ListOps", "the folder holding basic_train.tsv, basic_val.tsv, basic_test.tsv "
                                       "(or set data.generate=true)")
    T = max_len or DEFAULT_LEN["listops"]
    splits = {s: _split(*listops.read_tsv(root / f"basic_{s}.tsv"), T) for s in listops.SPLITS}
    cut = int(splits["train"].mask[:, -1].sum())
    notes = [f"ListOps from {root}; padded/truncated to {T}"] + ([f"{cut} training expressions reach the length "
                                                                  f"limit {T} (truncated)"] if cut else [])
    return TaskData("lra/listops", splits["train"], splits["val"], splits["test"], n_classes=10,
                    input_kind="tokens", n_inputs=len(listops.VOCAB), max_len=T, class_names=list("0123456789"),
                    notes=notes)


def load_text(path: str, max_len: int = 0, val_fraction: float = 0.1, split_seed: int = 0) -> TaskData:
    root = _need_dir(path, "LRA Text", "the aclImdb folder (with train/pos, train/neg, test/pos, test/neg)")
    T = max_len or DEFAULT_LEN["text"]

    def read(split):
        seqs, labels = [], []
        for label, sub in enumerate(("neg", "pos")):
            d = root / split / sub
            if not d.is_dir():
                raise FileNotFoundError(f"LRA Text: missing folder {d} (expected the aclImdb layout)")
            for f in sorted(d.glob("*.txt")):
                seqs.append(bytes_ids(regular_file(f, "LRA Text review").read_text(encoding="utf-8",
                                                                                  errors="replace"))[:T])
                labels.append(label)
        if not seqs:
            raise ValueError(f"LRA Text: no *.txt reviews under {root / split}")
        return seqs, labels

    return _carved("lra/text", _split(*read("train"), T), _split(*read("test"), T), val_fraction, split_seed,
                   n_classes=2, n_inputs=257, max_len=T, class_names=["neg", "pos"],
                   notes=[f"IMDB bytes from {root}; truncated to {T}"])


def read_retrieval_tsv(path: Path, max_len: int) -> Split:
    """Rows ``label, id1, id2, text1, text2``; x is [N, 2, T]."""
    regular_file(path, "LRA Retrieval file")
    docs, labels = [], []
    csv.field_size_limit(1 << 30)
    with open(path, newline="", encoding="utf-8", errors="replace") as f:  # bytes of text, as load_text reads them
        for lineno, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), start=1):
            if not row:
                continue
            where = f"{path}:{lineno}"
            if len(row) != 5:
                raise ValueError(f"{where}: expected 5 tab-separated fields (label, id1, id2, text1, text2), "
                                 f"got {len(row)}")
            try:
                label = int(float(row[0]))
            except ValueError:
                raise ValueError(f"{where}: label {row[0]!r} is not a number") from None
            if label not in (0, 1):
                raise ValueError(f"{where}: label {label} is not 0 or 1")
            docs += [bytes_ids(row[3])[:max_len], bytes_ids(row[4])[:max_len]]
            labels.append(label)
    if not labels:
        raise ValueError(f"{path}: no examples")
    x, m = pad_token_lists(docs, max_len)
    n = len(labels)
    return Split(x.view(n, 2, max_len), m.view(n, 2, max_len), torch.as_tensor(labels, dtype=torch.long))


def load_retrieval(path: str, max_len: int = 0) -> TaskData:
    root = _need_dir(path, "LRA Retrieval", "the folder holding new_aan_pairs.{train,eval,test}.tsv")
    T = max_len or DEFAULT_LEN["retrieval"]
    s = {k: read_retrieval_tsv(root / f"new_aan_pairs.{k}.tsv", T) for k in ("train", "eval", "test")}
    return TaskData("lra/retrieval", s["train"], s["eval"], s["test"], n_classes=2, input_kind="tokens",
                    n_inputs=257, max_len=T, pair=True, class_names=["unrelated", "cited"],
                    notes=[f"AAN document pairs from {root}; each document truncated to {T} bytes"])


def _pixel_split(pixels: np.ndarray, labels) -> Split:
    x = torch.from_numpy(pixels + 1).to(torch.int32)
    return Split(x, torch.ones_like(x, dtype=torch.bool), torch.as_tensor(np.asarray(labels), dtype=torch.long))


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that builds numpy arrays and plain data only: CIFAR-10's python batches are pickles,
    and a file that names anything else (a function to call) is refused before any of it runs."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR-10 batch never holds")
        return getattr(importlib.import_module(module), name)


def load_image(path: str, val_fraction: float = 0.1, split_seed: int = 0) -> TaskData:
    root = _need_dir(path, "LRA Image", "the cifar-10-batches-py folder (data_batch_1..5, test_batch)")

    def read(names):
        xs, ys = [], []
        for n in names:
            f = regular_file(root / n, "LRA Image: CIFAR-10 batch")
            try:
                with open(f, "rb") as fh:
                    d = _ArraysOnly(fh, encoding="bytes").load()
            except pickle.UnpicklingError as err:
                raise ValueError(f"{f} was not loaded: {err}; delete it and download CIFAR-10 again") from None
            try:
                xs.append(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                ys += list(d[b"labels"])
            except (KeyError, ValueError) as err:
                raise ValueError(f"{f}: not a CIFAR-10 python batch ({err})") from None
        rgb = np.concatenate(xs)
        grey = 0.2989 * rgb[:, 0] + 0.5870 * rgb[:, 1] + 0.1140 * rgb[:, 2]  # [N, 32, 32], levels 0-255
        return np.clip(grey, 0, 255).astype(np.int64).reshape(len(rgb), -1), ys

    return _carved("lra/image", _pixel_split(*read([f"data_batch_{i}" for i in range(1, 6)])),
                   _pixel_split(*read(["test_batch"])), val_fraction, split_seed, n_classes=10, n_inputs=257,
                   max_len=1024, notes=[f"CIFAR-10 grey-scale pixels from {root}"])


def load_pathfinder(path: str, difficulty: str = "curv_contour_length_14") -> TaskData:
    base = _need_dir(path, "LRA Pathfinder", "the pathfinder32 folder of the LRA release")
    root = base / difficulty
    meta = sorted((root / "metadata").glob("*.npy"), key=lambda p: (len(p.stem), p.stem))
    if not meta:
        raise FileNotFoundError(f"LRA Pathfinder: no metadata/*.npy under {root} "
                                f"(difficulties: {', '.join(sorted(p.name for p in base.iterdir() if p.is_dir()))})")
    from PIL import Image

    def read(files):
        xs, ys = [], []
        for mf in files:
            for lineno, line in enumerate(regular_file(mf, "Pathfinder metadata").read_text(errors="replace")
                                          .splitlines(), start=1):
                if not line.strip():
                    continue
                parts = line.split()
                if len(parts) < 4 or parts[3] not in ("0", "1"):
                    raise ValueError(f"{mf}:{lineno}: expected 'imgs/<k> <file>.png <..> <label 0|1> ...', "
                                     f"got {line[:80]!r}")
                img = root / parts[0] / parts[1]
                try:
                    a = np.asarray(Image.open(regular_file(img, "image")).convert("L"), dtype=np.int64)
                except (OSError, ValueError) as err:
                    raise ValueError(f"{mf}:{lineno}: cannot read image {img}: {err}") from None
                xs.append(a.reshape(-1))
                ys.append(int(parts[3]))
        return _pixel_split(np.stack(xs), ys)

    n = len(meta)
    if n < 3:
        raise ValueError(f"LRA Pathfinder: need at least 3 metadata files under {root} for train/val/test, got {n}")
    a = max(1, int(0.8 * n))
    b = min(a + max(1, int(0.1 * n)), n - 1)
    train = read(meta[:a])
    return TaskData(f"lra/pathfinder-{difficulty}", train, read(meta[a:b]), read(meta[b:]), n_classes=2,
                    input_kind="tokens", n_inputs=257, max_len=train.x.shape[1], class_names=["disconnected", "connected"],
                    notes=[f"Pathfinder {difficulty} from {root}; metadata files {a}/{b - a}/{n - b}"])
