"""primal_dt.classify_config: every numeric option of ``python -m primal_dt.classify`` is checked
before any data is loaded."""

import dataclasses

import pytest

from agents import train_config
from primal_dt.classify_config import ClassifyConfig, build_config, check_config


def test_every_numeric_option_is_valid_or_named(fuzz_options):
    kinds = {k: "float" if isinstance(v, float) else "int" for k, v in
             train_config.flat(dataclasses.asdict(ClassifyConfig())).items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("data.listops.")}
    assert {"train.lr", "arch.d_model", "primal.eta", "data.val_fraction", "seed"} <= set(kinds)
    fuzz_options(lambda argv: check_config(build_config(argv)[0]), kinds, base=["task=uea/JapaneseVowels-fast"],
                 examples=80)


@pytest.mark.parametrize("argv, message", [
    (["train.lr=nan"], "train.lr must be > 0, got nan"),
    (["arch.dropout=1"], r"arch.dropout must be in \[0, 1\), got 1.0"),
    (["data.split_seed=-1"], r"data.split_seed must be in \[0, 4294967296\), got -1"),
    (["arch.d_model=30", "arch.n_heads=4"], "arch.d_model=30 must be divisible by arch.n_heads=4"),
    (["arch.layers=1000000000"], "arch.layers=1000000000, arch.d_model=64.* need about .* parameters"),
])
def test_bad_values_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        check_config(build_config(["task=uea/JapaneseVowels-fast", *argv])[0])
