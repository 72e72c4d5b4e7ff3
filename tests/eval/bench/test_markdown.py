"""The benchmarks write their measured tables themselves (``--markdown``): a Markdown page headed by the
command and the machine, whose tables parse (every row as wide as its header), written atomically."""

import json
import re

import pytest
import torch

from eval.bench import timing, train


def tables(text: str) -> list[list[dict]]:
    """Every Markdown table of ``text`` as a list of {column: cell}; an AssertionError for a malformed one."""
    out, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
        elif rows:
            head, sep, *body = rows
            assert set("".join(sep)) == {"-"} and len(sep) == len(head), rows[:2]
            assert all(len(r) == len(head) for r in body), rows
            out.append([dict(zip(head, r)) for r in body])
            rows = []
    return out


def test_the_training_bench_writes_its_tables_with_the_machine_and_the_command(tmp_path, capsys):
    md, js = tmp_path / "train.md", tmp_path / "train.json"
    argv = ["--sizes", "original", "--batch", "2", "--K", "4", "--rounds", "1", "--steps", "1", "--warmup", "0",
            "--no-hf", "--device", "cpu", "--markdown", str(md), "--json", str(js)]
    res = train.main(argv)
    text = md.read_text()
    assert text.startswith("# Training step on cpu: our DT models")
    assert f"Command: `python -m eval.bench.train {' '.join(argv)}`" in text
    machine = res["machine"]
    assert f"Machine: {machine['cpu']}, {machine['cores']} core(s), 1 torch thread(s)" in text
    assert f"torch {torch.__version__}" in text and machine["date"] in text
    (steps,) = tables(text)
    assert [r["model"] for r in steps] == list(res["results"][0]["models"])
    assert all(float(r["ms per step"]) > 0 for r in steps)
    assert json.loads(js.read_text())["machine"] == machine
    assert not list(tmp_path.glob("*.tmp*")), "no temporary file is left beside the outputs"


def test_a_cell_holding_a_bar_does_not_break_its_row(tmp_path):
    res = {"machine": timing.machine("python -m x", ["a b", "c|d"])}
    page = tmp_path / "t.md"
    timing.write(res, None, str(page), "t", [timing.table(["name", "value"], [["a|b", 1], ["c", 2]])], ["a note"])
    text = page.read_text()
    assert "Command: `python -m x 'a b' 'c|d'`" in text and text.rstrip().endswith("a note")
    assert tables(text) == [[{"name": "a\\|b", "value": "1"}, {"name": "c", "value": "2"}]]


@pytest.mark.parametrize("option", ["--markdown", "--json"])
def test_an_output_the_bench_cannot_write_is_refused_before_it_measures(option, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(["--no-hf", option, str(tmp_path / "missing" / "a.md")])
    assert exit_.value.code == 2 and f"error: {option}=" in capsys.readouterr().err
