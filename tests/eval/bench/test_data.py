"""eval.bench.data's command line: numeric options and the dataset name are checked before timing."""

import pytest

from eval.bench.data import main, parse_args


def test_every_numeric_option_is_valid_or_named(fuzz_options):
    fuzz_options(parse_args, {"--batch": "int", "--K": "int", "--reward_scale": "float", "--repeat": "int",
                              "--threads": "int"}, examples=60)


def test_an_unknown_dataset_is_one_error_line_and_exit_status_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--dataset", "hopper-mediun"])
    assert exit_.value.code == 2 and "--dataset hopper-mediun: unknown dataset name" in capsys.readouterr().err
