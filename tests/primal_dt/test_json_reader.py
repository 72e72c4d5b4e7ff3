"""primal_dt.run.json_reader: every JSON file the package reads is bounded and checked, so a damaged or
planted file is one error naming it, never a hang (a FIFO), an exhausted memory (a link to /dev/zero), a
RecursionError (deep nesting) or a number no table can show (1e308, 10**400)."""

import math
import os
import threading

import pytest

from primal_dt.run import json_reader
from primal_dt.run.json_reader import JSONError


def read_in_time(path, **kw):
    """``json_reader.read`` in a thread, so a reader that blocks fails the test instead of hanging it."""
    box = {}

    def target():
        try:
            box["value"] = json_reader.read(path, **kw)
        except Exception as err:  # noqa: BLE001 - handed to the test
            box["error"] = err

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), f"reading {path} blocked"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_plain_file_is_read(tmp_path):
    (tmp_path / "a.json").write_text('{"x": [1, 2.5, "s"], "y": null}')
    assert read_in_time(tmp_path / "a.json") == {"x": [1, 2.5, "s"], "y": None}
    with pytest.raises(FileNotFoundError):
        json_reader.read(tmp_path / "missing.json")


def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path):
    fifo = tmp_path / "summary.json"
    os.mkfifo(fifo)
    with pytest.raises(JSONError, match=rf"{fifo} is not a regular file"):
        read_in_time(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    with pytest.raises(JSONError, match=rf"{zero} is not a regular file"):
        read_in_time(zero)
    with pytest.raises(JSONError, match="not a regular file"):
        read_in_time(tmp_path)


def test_size_nesting_and_encoding_are_bounded(tmp_path):
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 600_000 + "0]")
    with pytest.raises(JSONError, match=rf"{big} is larger than 1,048,576 bytes"):
        read_in_time(big)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 50_000 + "]" * 50_000)
    with pytest.raises(JSONError, match="nests 50000 levels deep"):
        read_in_time(deep)
    assert json_reader.parse('{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', "x") == {"a": "[" * 40}  # in a string
    with pytest.raises(JSONError, match="x is not UTF-8"):
        json_reader.parse(b'{"a": "\xff"}', "x")
    with pytest.raises(JSONError, match="x is not valid JSON"):
        json_reader.parse('{"a": ', "x")
    with pytest.raises(JSONError, match=r"x holds a string that is not text \(the lone surrogate \\ud800\)"):
        json_reader.parse('{"model": "\\ud800"}', "x")  # valid JSON; printed or written: UnicodeEncodeError
    assert json_reader.parse('["\\ud83d\\ude00"]', "x") == ["\U0001F600"]  # a pair is one character


@pytest.mark.parametrize("number", ["1" + "0" * 400, "1e308", "1e400", "-1e16", "NaN", "Infinity", "-Infinity"])
def test_numbers_beyond_any_file_of_the_package_are_refused(number):
    with pytest.raises(JSONError, match=r"summary.json holds the number .*not a finite number of at most 1e\+15"):
        json_reader.parse(f'{{"final": {{"target3600": {{"normalized_mean": {number}}}}}}}', "summary.json")


def test_nan_and_infinity_only_where_the_reader_flags_them():
    got = json_reader.parse('[NaN, Infinity, -Infinity, 1e15]', "s", nonfinite=True)
    assert math.isnan(got[0]) and got[1:] == [math.inf, -math.inf, 1e15]
    with pytest.raises(JSONError, match="holds the number 1e400"):
        json_reader.parse("[1e400]", "s", nonfinite=True)
