"""UEA loading through aeon (the bundled JapaneseVowels) and its preprocessing."""

import os
import re

import numpy as np
import pytest
import torch

from primal_dt.tasks import DataConfig, load_task
from primal_dt.tasks.dataset import carve_validation
from primal_dt.tasks.uea import clean_series, load_uea


@pytest.fixture(scope="module")
def jv():
    return load_uea("JapaneseVowels", val_fraction=0.2, split_seed=0)


def test_japanese_vowels_shapes_masks_and_scaling(jv):
    assert jv.n_classes == 9 and jv.n_inputs == 12 and jv.input_kind == "continuous"
    assert len(jv.train) + len(jv.val) == 270 and len(jv.test) == 370
    assert jv.max_len == max(int(s.mask.sum(1).max()) for s in (jv.train, jv.val))
    for s in (jv.train, jv.val, jv.test):
        lengths = s.mask.sum(1)
        assert lengths.min() >= 7
        # right-padded: real tokens first, zeros after
        assert torch.equal(s.mask, torch.arange(jv.max_len)[None] < lengths[:, None])
        assert (s.x[~s.mask] == 0).all()
    real = jv.train.x[jv.train.mask]  # statistics come from the fitting split
    assert torch.allclose(real.mean(0), torch.zeros(12), atol=1e-5)
    assert torch.allclose(real.std(0, unbiased=False), torch.ones(12), atol=1e-4)
    assert set(jv.val.y.tolist()) == set(range(9)), "stratified validation split keeps every class"


def test_paper_protocol_and_subsets():
    d = load_task(DataConfig(kind="uea", name="JapaneseVowels", max_train=30, max_test=20), with_val=False)
    assert d.val is None and len(d.train) == 30 and len(d.test) == 20


def test_clean_series_interpolates_and_trims():
    s = np.array([[1.0, np.nan, 3.0, np.nan, np.nan], [np.nan, 2.0, 4.0, np.nan, np.nan]])  # [C=2, T=5]
    out = clean_series(s)
    assert out.shape == (3, 2)  # trailing all-NaN steps end the series
    np.testing.assert_allclose(out[:, 0], [1, 2, 3])
    np.testing.assert_allclose(out[:, 1], [2, 2, 4])  # edge takes the nearest observation


def test_carve_validation_is_stratified_and_disjoint():
    y = np.array([0] * 10 + [1] * 5 + [2] * 2)
    fit, val = carve_validation(y, 0.2, seed=1)
    assert not set(fit) & set(val) and len(fit) + len(val) == len(y)
    assert sorted(np.bincount(y[val]).tolist()) == [1, 1, 2]


def test_unavailable_set_gives_clear_error(monkeypatch):
    import aeon.datasets

    def offline(*a, **k):
        raise ValueError("Failed to retrieve Zenodo metadata: Name or service not known")

    monkeypatch.setattr(aeon.datasets, "load_classification", offline)
    with pytest.raises(RuntimeError) as err:
        load_uea("Heartbeat")
    msg = str(err.value)
    assert "Heartbeat" in msg and "JapaneseVowels" in msg and "Heartbeat_TRAIN.ts" in msg
    with pytest.raises(RuntimeError, match="Did you mean 'Heartbeat'"):
        load_uea("Heartbeet")


HEADER = ("@problemName {n}\n@timeStamps false\n@missing false\n@univariate false\n@dimensions 2\n"
          "@equalLength true\n@seriesLength 3\n@classLabel true a b\n@data\n")
GOOD = "1,2,3:4,5,6:a\n2,3,4:5,6,7:b\n1,1,3:4,5,6:a\n2,3,4:5,6,7:b\n"


@pytest.mark.parametrize("train, test, message", [
    ("not a ts file", GOOD, "Bad_TRAIN.ts): its train split holds no series, or an empty one"),
    ("", GOOD, "Bad_TRAIN.ts): its train split holds no series"),
    (GOOD, "1,2,3:a\n", "its series have 1 and 2 channels"),  # broadcast against 2 channels' statistics, once
    (GOOD.replace("1,1,3", "1,1e999,3"), GOOD, "its train split holds infinite values"),
    ("1,2,3:4,5,6:a\n1,2,4:4,5,6:a\n", GOOD.replace(":b", ":a"), "training split 1 class(es)"),
], ids=["not-ts", "empty", "channels", "inf", "one-class"])
def test_a_ts_file_a_classifier_cannot_learn_from_is_one_error(tmp_path, train, test, message):
    d = tmp_path / "Bad"
    d.mkdir()
    for split, body in (("TRAIN", train), ("TEST", test)):
        (d / f"Bad_{split}.ts").write_text(HEADER.format(n="Bad") + body)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_uea("Bad", str(tmp_path), val_fraction=0)
    (d / "Bad_TRAIN.ts").unlink()
    os.mkfifo(d / "Bad_TRAIN.ts")  # opened by aeon, it waited for a writer forever
    with pytest.raises(ValueError, match="Bad_TRAIN.ts is not a regular file"):
        load_uea("Bad", str(tmp_path))
