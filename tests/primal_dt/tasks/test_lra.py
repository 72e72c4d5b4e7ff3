"""LRA loaders on small files written here in the formats the benchmark is built from."""

import pickle

import numpy as np
import pytest
import torch

from primal_dt.tasks import DataConfig, load_task
from primal_dt.tasks import lra


def test_listops_folder(tmp_path):
    rows = ["Source\tTarget", "( ( ( [MAX 2 ) 9 ) ] )\t9", "[SM 4 7 ]\t1"]
    for s in ("train", "val", "test"):
        (tmp_path / f"basic_{s}.tsv").write_text("\n".join(rows) + "\n")
    d = load_task(DataConfig(kind="listops", path=str(tmp_path), max_len=6))
    assert d.n_classes == 10 and d.train.y.tolist() == [9, 1] and d.max_len == 6
    assert d.train.mask.sum(1).tolist() == [4, 4] and d.train.x.dtype == torch.int32


def test_listops_missing_folder_points_to_generator(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.generate=true"):
        load_task(DataConfig(kind="listops", path=str(tmp_path / "nope")))


def test_text_aclimdb_layout(tmp_path):
    for split in ("train", "test"):
        for label in ("pos", "neg"):
            (tmp_path / split / label).mkdir(parents=True)
            for i in range(5):
                (tmp_path / split / label / f"{i}_7.txt").write_text(f"{label} review {i} é")
    d = load_task(DataConfig(kind="text", path=str(tmp_path), max_len=12, val_fraction=0.2))
    assert (len(d.train), len(d.val), len(d.test)) == (8, 2, 10)
    assert d.n_inputs == 257 and d.max_len == 12
    first = d.test.x[0][d.test.mask[0]]
    assert bytes((first - 1).tolist()).decode() == "neg review 0"[:12]


def _retrieval(path, rows):
    path.write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))


def test_retrieval_pairs(tmp_path):
    for k in ("train", "eval", "test"):
        _retrieval(tmp_path / f"new_aan_pairs.{k}.tsv", [[1.0, "a1", "b1", "doc one", "doc two, longer"],
                                                          [0, "a2", "b2", "x", "y"]])
    d = load_task(DataConfig(kind="retrieval", path=str(tmp_path), max_len=10))
    assert d.pair and d.train.x.shape == (2, 2, 10) and d.train.y.tolist() == [1, 0]
    assert d.train.mask[0].sum(1).tolist() == [7, 10]  # second document truncated to max_len


def test_retrieval_malformed_row(tmp_path):
    _retrieval(tmp_path / "new_aan_pairs.train.tsv", [[1, "a", "b", "t1", "t2"], [1, "a", "b", "only four"]])
    with pytest.raises(ValueError, match=r"new_aan_pairs.train.tsv:2: expected 5 tab-separated fields"):
        lra.read_retrieval_tsv(tmp_path / "new_aan_pairs.train.tsv", 8)


def test_image_cifar_batches(tmp_path):
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}", 10) for i in range(1, 6)] + [("test_batch", 4)]:
        with open(tmp_path / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         b"labels": list(range(10))[:n]}, f)
    d = load_task(DataConfig(kind="image", path=str(tmp_path), val_fraction=0.1))
    assert (len(d.train), len(d.val), len(d.test)) == (40, 10, 4)  # one per class at least
    assert d.max_len == 1024 and d.train.mask.all() and 1 <= d.train.x.min() and d.train.x.max() <= 256
    with open(tmp_path / "test_batch", "rb") as f:
        raw = pickle.load(f)[b"data"].reshape(-1, 3, 1024).astype(float)
    g = (0.2989 * raw[:, 0] + 0.587 * raw[:, 1] + 0.114 * raw[:, 2]).astype(int) + 1
    assert torch.equal(d.test.x.long(), torch.from_numpy(g))


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (eval, (f"__import__('pathlib').Path({self.marker!r}).write_text('ran')",))


def test_a_cifar_batch_holding_a_pickle_payload_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(tmp_path / name, "wb") as f:
            pickle.dump({b"data": _Payload(marker), b"labels": [0]}, f)
    with pytest.raises(ValueError, match=r"data_batch_1 was not loaded: it names builtins\.eval"):
        load_task(DataConfig(kind="image", path=str(tmp_path), val_fraction=0.1))
    assert not marker.exists()


def test_pathfinder_release_layout(tmp_path):
    from PIL import Image

    root = tmp_path / "curv_baseline"
    (root / "metadata").mkdir(parents=True)
    (root / "imgs" / "0").mkdir(parents=True)
    for m in range(10):
        lines = []
        for k in range(2):
            name = f"sample_{m}_{k}.png"
            Image.fromarray(np.full((32, 32), 10 * m + k, dtype=np.uint8)).save(root / "imgs" / "0" / name)
            lines.append(f"imgs/0 {name} 0 {k} 5 1.5 9 6 2 2")
        (root / "metadata" / f"{m}.npy").write_text("\n".join(lines) + "\n")
    d = load_task(DataConfig(kind="pathfinder", path=str(tmp_path), name="curv_baseline"))
    assert (len(d.train), len(d.val), len(d.test)) == (16, 2, 2)
    assert d.train.y.tolist() == [0, 1] * 8 and d.max_len == 1024
    assert int(d.test.x[0, 0]) == 10 * 9 + 0 + 1
    (root / "metadata" / "3.npy").write_text("imgs/0 sample_3_0.png 0 maybe\n")
    with pytest.raises(ValueError, match=r"3.npy:1: expected"):
        load_task(DataConfig(kind="pathfinder", path=str(tmp_path), name="curv_baseline"))
