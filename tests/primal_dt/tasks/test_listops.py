"""ListOps generator against an independent evaluator, and the release-format TSV reader."""

import csv
import os

import numpy as np
import pytest

from primal_dt.tasks import listops
from primal_dt.tasks.listops import ListOpsSpec


def evaluate_tokens(source: str) -> int:
    """A stack evaluator over the printed expression, sharing no code with the generator."""
    stack, result = [], None
    for tok in source.replace("(", " ").replace(")", " ").split():
        if tok.startswith("["):
            stack.append((tok, []))
        elif tok == "]":
            op, args = stack.pop()
            v = {"[MAX": max, "[MIN": min, "[SM": lambda a: sum(a) % 10,
                 "[MED": lambda a: int(np.median(a))}[op](args)
            (stack[-1][1].append(v) if stack else None)
            result = v
        else:
            assert tok.isdigit() and len(tok) == 1, tok
            if stack:
                stack[-1][1].append(int(tok))
            else:
                result = int(tok)
    assert not stack, "unbalanced expression"
    return result


def test_generated_expressions_are_valid_and_targets_match():
    spec = ListOpsSpec(n_train=60, n_val=10, n_test=10, min_length=20, max_length=120, max_depth=6, max_args=5, seed=3)
    data = listops.generate(spec)
    assert [len(data[s]) for s in listops.SPLITS] == [60, 10, 10]
    sources = [src for s in listops.SPLITS for src, _ in data[s]]
    assert len(set(sources)) == len(sources), "examples must be distinct"
    for split in listops.SPLITS:
        for src, target in data[split]:
            assert src.count("(") == src.count(")")
            n = len(listops.tokenize(src, "t"))
            assert spec.min_length < n < spec.max_length
            assert target == evaluate_tokens(src)
            assert src.startswith("( ") and 0 <= target <= 9


def test_release_rendering():
    assert listops.to_string(("[MAX", [2, 9])) == "( ( ( [MAX 2 ) 9 ) ] )"
    assert evaluate_tokens("( ( ( [MED 1 ) 2 ) ] )") == listops.evaluate(("[MED", [1, 2])) == 1


def test_tsv_roundtrip_and_cli(tmp_path):
    listops.main([f"out={tmp_path}", "n_train=5", "n_val=2", "n_test=2", "min_length=5", "max_length=40"])
    seqs, targets = listops.read_tsv(tmp_path / "basic_train.tsv")
    assert len(seqs) == 5 and all(0 <= t <= 9 for t in targets)
    with open(tmp_path / "basic_train.tsv") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    assert rows[0] == ["Source", "Target"]
    assert [evaluate_tokens(r[0]) for r in rows[1:]] == targets
    # the release's unbracketed spelling reads to the same ids
    assert listops.tokenize("[MAX 2 9 [MIN 4 7 ] 0 ]", "x") == listops.tokenize(
        "( ( ( ( [MAX 2 ) 9 ) ( ( ( [MIN 4 ) 7 ) ] ) ) 0 ) ] )", "x")


@pytest.mark.parametrize("body, message", [
    ("Src\tTarget\n", ":1: expected the header"),
    ("Source\tTarget\n[MAX 1 2 ]\t2\n[MAX 1 2 ]\n", ":3: expected 2 tab-separated fields"),
    ("Source\tTarget\n[MAX 1 2 ]\tx\n", ":2: target 'x' is not an integer"),
    ("Source\tTarget\n[MAX 1 2 ]\t12\n", ":2: target 12 is outside 0-9"),
    ("Source\tTarget\n[FOO 1 2 ]\t2\n", ":2: unknown ListOps token '[FOO'"),
])
def test_malformed_tsv_names_file_and_line(tmp_path, body, message):
    p = tmp_path / "basic_train.tsv"
    p.write_text(body)
    with pytest.raises(ValueError) as err:
        listops.read_tsv(p)
    assert str(p) + message in str(err.value)


def test_a_data_file_that_is_no_text_file_is_one_error(tmp_path):
    """A FIFO hung the run (waiting for a writer), a directory ended it in a traceback, a stray byte in a message
    that named no file."""
    (tmp_path / "bytes.tsv").write_bytes(b"Source\tTarget\n[MAX 1 \xff ]\t2\n")
    with pytest.raises(ValueError, match=rf"{tmp_path}/bytes.tsv:2: unknown ListOps token"):
        listops.read_tsv(tmp_path / "bytes.tsv")
    (tmp_path / "long.tsv").write_text("Source\tTarget\n[MAX " + "1 " * 70_000 + "]\t1\n")
    assert len(listops.read_tsv(tmp_path / "long.tsv")[0][0]) == 70_002  # past csv's default field limit
    os.mkfifo(tmp_path / "fifo.tsv")
    (tmp_path / "dir.tsv").mkdir()
    for name in ("fifo.tsv", "dir.tsv"):
        with pytest.raises(ValueError, match=f"ListOps file {tmp_path / name} is not a regular file"):
            listops.read_tsv(tmp_path / name)


def test_an_unwritable_out_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="error: could not write the ListOps file .*a file is in the way"):
        listops.main([f"out={tmp_path / 'file'}", "n_train=2", "n_val=1", "n_test=1", "min_length=5",
                      "max_length=30"])


def test_bad_generator_options():
    with pytest.raises(ValueError, match="min_length < max_length"):
        ListOpsSpec(min_length=50, max_length=40).check()
