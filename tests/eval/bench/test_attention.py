"""eval.bench.attention's command line: every numeric option is checked before a configuration runs."""

import pytest

from eval.bench.attention import parse_args


def test_every_numeric_option_is_valid_or_named(fuzz_options):
    kinds = {f"--{k}": "int" for k in ("batch", "width", "heads", "step_width", "step_heads", "step_repeat", "repeat",
                                        "threads")}
    kinds.update({"--lengths": "ints", "--contexts": "ints", "--budget_s": "float", "--timeout": "float",
                  "--mem_limit_gb": "float"})
    fuzz_options(parse_args, kinds, examples=60)


def test_a_bad_value_is_one_error_line_and_exit_status_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--lengths", "256,0"])
    assert exit_.value.code == 2 and "error: --lengths must hold numbers that are >= 1, got 256, 0" in \
        capsys.readouterr().err
