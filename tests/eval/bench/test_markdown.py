"""The benchmarks write their measured tables themselves (``--markdown``): a Markdown page headed by the
command and the machine, whose tables parse (every row as wide as its header), written atomically."""

import json
import re

import pytest
import torch

from eval.bench import attention, timing


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


def test_the_attention_bench_writes_its_tables_with_the_machine_and_the_command(tmp_path, capsys):
    md, js = tmp_path / "attention.md", tmp_path / "attention.json"
    argv = ["--skip_train", "--contexts", "1,3", "--step_repeat", "1", "--step_width", "8",
            "--step_mechanisms", "softmax", "primal:s=2", "--markdown", str(md), "--json", str(js)]
    res = attention.main(argv)
    text = md.read_text()
    assert text.startswith("# One attention layer")
    assert f"Command: `python -m eval.bench.attention {' '.join(argv)}`" in text
    machine = res["machine"]
    assert f"Machine: {machine['cpu']}, {machine['cores']} core(s), 1 torch thread(s)" in text
    assert f"torch {torch.__version__}" in text and machine["date"] in text
    (steps,) = tables(text)
    assert [(r["mechanism"], r["context"]) for r in steps] == [("softmax", "1"), ("softmax", "3"),
                                                               ("primal:s=2", "1"), ("primal:s=2", "3")]
    assert all(float(r["step us"]) > 0 for r in steps)
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
        attention.main(["--skip_train", option, str(tmp_path / "missing" / "a.md")])
    assert exit_.value.code == 2 and f"error: {option}=" in capsys.readouterr().err
