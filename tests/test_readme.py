"""The README and the docs run: every fenced ```bash or ```python block on the line right after a
``<!-- runnable -->`` line, in README.md or any Markdown file under docs/, is executed, so a snippet
that stops working fails the suite (and CI).

How a block runs:
- all runnable blocks share one scratch working directory per test session. The README's run in
  order, as for a newcomer who follows it from the top; a doc's blocks run after the README's (a doc
  is read after the first run) and after the earlier blocks of the same doc, in order. Relative paths
  (``runs/``, ``load_agent("runs/...")``) resolve there, so a later block can use the run an earlier
  one trained, and the checkout's own ``runs/`` is never touched. A block must not reach files of the
  checkout by a relative path;
- the checkout is importable (on ``PYTHONPATH``, as ``pip install -e .`` makes it), with
  ``PRIMAL_DT_OFFLINE=1`` (no dataset download is tried; the bundled replica serves) and one torch
  thread (CI has 2 cores);
- ```bash blocks run with ``bash -euo pipefail``: every command must succeed;
- ```python blocks run as a script in a fresh ``python`` process, which must exit 0.

``<!-- runnable: slow -->`` marks a block too slow for the default run (it runs under
``pytest -m slow``). Running one block alone first runs its prerequisites (once per session): the
README's default-speed blocks, then the default-speed blocks above it in its own file, since it may
need what they made; a slow block is never such a prerequisite, so later blocks must not depend on one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
MARKER = re.compile(r"^\s*<!--\s*runnable(?::\s*(?P<tag>[\w-]+))?\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
LANGS = ("bash", "python")
TIMEOUT = {False: 600, True: 1800}  # seconds per block: default-speed, slow


@dataclass(frozen=True)
class Block:
    line: int
    """line number of the opening fence in its file (1-based)"""
    lang: str
    code: str
    slow: bool = False
    file: str = "README.md"
    """the file, relative to the checkout"""

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}-{self.lang}"


def extract(text: str, file: str = "README.md") -> tuple[list[Block], list[str]]:
    """(runnable blocks, problems): a marker that is not followed at once by a ```bash or ```python
    fence, an unknown marker tag or an unclosed block is a problem, so a broken marker cannot
    silently drop a block from the test."""
    lines = text.splitlines()
    blocks, problems = [], []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        tag = m["tag"]
        if tag not in (None, "slow"):
            problems.append(f"{file} line {i + 1}: unknown marker tag {tag!r} (use <!-- runnable --> or "
                            "<!-- runnable: slow -->)")
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence["lang"] not in LANGS:
            problems.append(f"{file} line {i + 1}: a runnable marker must be followed directly by a ```bash or ```python "
                            f"fence, found {lines[i + 1] if i + 1 < len(lines) else 'the end of the file'!r}")
            continue
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            problems.append(f"{file} line {i + 2}: the runnable block is never closed")
            continue
        blocks.append(Block(i + 2, fence["lang"], "\n".join(lines[i + 2:end]) + "\n", slow=tag == "slow",
                            file=file))
    return blocks, problems


def extract_all(paths: list[Path]) -> tuple[list[Block], list[str]]:
    """The blocks and problems of every file, in the order given (README first)."""
    blocks, problems = [], []
    for path in paths:
        b, p = extract(path.read_text(), str(path.relative_to(ROOT)))
        blocks += b
        problems += p
    return blocks, problems


BLOCKS, PROBLEMS = extract_all([README, *DOCS])


def prerequisites(block: Block, blocks: list[Block]) -> list[Block]:
    """The default-speed blocks that run before ``block``: the README's, then those above it in its file."""
    before = [b for b in blocks if b.file == "README.md" and b.file != block.file]
    mine = [b for b in blocks if b.file == block.file]
    before += mine[:mine.index(block)]
    return [b for b in before if not b.slow]


def run_block(block: Block, cwd: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PRIMAL_DT_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    if block.lang == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    else:
        stem = re.sub(r"\W", "_", block.file)
        script = cwd / f"{stem}_line{block.line}.py"
        script.write_text(block.code)
        argv = [sys.executable, str(script)]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout or TIMEOUT[block.slow])


def failure(block: Block, p: subprocess.CompletedProcess) -> str:
    return (f"the runnable block at {block.id} failed (exit {p.returncode}):\n{block.code}\n"
            f"--- stdout (end) ---\n{p.stdout[-3000:]}\n--- stderr (end) ---\n{p.stderr[-3000:]}")


class Workspace:
    """The scratch directory the blocks share, and which blocks already ran there."""

    def __init__(self, path: Path):
        self.path = path
        self.results: dict[Block, subprocess.CompletedProcess] = {}

    def run(self, block: Block) -> subprocess.CompletedProcess:
        for earlier in prerequisites(block, BLOCKS):
            if earlier not in self.results:
                p = self.results[earlier] = run_block(earlier, self.path)
                assert p.returncode == 0, f"(needed by {block.id}) " + failure(earlier, p)
        if block not in self.results:
            self.results[block] = run_block(block, self.path)
        return self.results[block]


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("readme"))


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])
                                   for b in BLOCKS])
def test_marked_block_runs(block, workspace):
    p = workspace.run(block)
    assert p.returncode == 0, failure(block, p)


# -- the extractor and the runner themselves -----------------------------------------------------------
def test_the_readme_and_docs_have_their_runnable_blocks_and_no_broken_marker():
    assert PROBLEMS == []
    readme = [b for b in BLOCKS if b.file == "README.md" and b.lang == "bash" and not b.slow]
    assert any("preset=smoke" in b.code for b in readme), "the smoke run (the first thing a newcomer runs)"
    assert any("eval.rollout" in b.code for b in readme)
    docs = {b.file for b in BLOCKS} - {"README.md"}
    assert {"docs/evaluation.md", "docs/deployment.md"} <= docs, docs
    python = [b for b in BLOCKS if b.lang == "python"]
    assert any("load_agent(" in b.code for b in python), "the load_agent snippet"
    assert any("agents.export" in b.code for b in BLOCKS), "the export commands"
    # every Python snippet of the README and the docs is runnable
    fences = sum(len(re.findall(r"^```python\s*$", p.read_text(), flags=re.M)) for p in [README, *DOCS])
    assert len(python) == fences


def test_a_docs_block_runs_after_the_readme_and_the_blocks_above_it():
    readme = [Block(1, "bash", "a\n"), Block(5, "bash", "slow\n", slow=True), Block(9, "bash", "b\n")]
    doc = [Block(3, "python", "c\n", file="docs/x.md"), Block(7, "bash", "d\n", slow=True, file="docs/x.md"),
           Block(11, "bash", "e\n", file="docs/x.md")]
    other = [Block(2, "bash", "f\n", file="docs/y.md")]
    blocks = readme + doc + other
    assert prerequisites(readme[2], blocks) == [readme[0]]
    assert prerequisites(doc[0], blocks) == [readme[0], readme[2]]
    assert prerequisites(doc[2], blocks) == [readme[0], readme[2], doc[0]]  # no slow block, no other doc's
    assert prerequisites(other[0], blocks) == [readme[0], readme[2]]


def test_extract_finds_marked_blocks_and_reports_broken_markers():
    text = "\n".join([
        "# T", "<!-- runnable -->", "```bash", "echo one", "echo two", "```",  # 2: a block
        "```bash", "not marked", "```",  # 7: ignored
        "<!-- runnable: slow -->", "```python", "print(1)", "```",  # 10: a slow block
        "<!-- runnable -->", "", "```bash", "echo gap", "```",  # 14: blank line between: a problem
        "<!-- runnable -->", "```text", "x", "```",  # 19: not a language we run
        "<!-- runnable: fast -->", "```bash", "true", "```",  # 23: unknown tag
        "<!-- runnable -->", "```python", "unclosed",  # 27: never closed
    ])
    blocks, problems = extract(text, "docs/t.md")
    assert blocks == [Block(3, "bash", "echo one\necho two\n", file="docs/t.md"),
                      Block(11, "python", "print(1)\n", slow=True, file="docs/t.md")]
    assert [p.split(":")[0] for p in problems] == [f"docs/t.md line {n}" for n in (14, 19, 23, 28)]
    assert "followed directly by a ```bash or ```python fence, found ''" in problems[0]


def test_a_failing_block_fails(tmp_path):
    """The runner catches a failure anywhere in a block: bash stops at the first failing command
    (and inside a pipeline), python at an exception."""
    for code in ("echo before\nfalse\necho after\n", "false | cat\necho after\n", "ls no-such-file\n"):
        p = run_block(Block(1, "bash", code), tmp_path, timeout=60)
        assert p.returncode != 0 and "after" not in p.stdout
    p = run_block(Block(2, "python", "import agents\nraise SystemExit('snippet broke')\n"), tmp_path, timeout=120)
    assert p.returncode == 1 and "snippet broke" in p.stderr
    p = run_block(Block(3, "bash", "pwd\nls\n"), tmp_path, timeout=60)  # it runs in the scratch directory
    assert p.returncode == 0 and p.stdout.splitlines()[0] == str(tmp_path)


def test_ci_runs_the_readmes_setup_and_test_commands():
    """.ci/run installs exactly as the README's development setup says (the ``.[dev]`` block of its
    setup section, beside the lean install) and runs its test command."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    text = README.read_text()
    setup = re.search(r"^## Setup\n(?P<section>.*?)^## ", text, flags=re.S | re.M)
    tests = re.search(r"^## Tests\n.*?```bash\n(?P<code>.*?)```", text, flags=re.S | re.M)
    assert setup and tests
    blocks = re.findall(r"^```bash\n(.*?)^```", setup["section"], flags=re.S | re.M)
    dev = [b for b in blocks if '".[dev]"' in b]
    assert len(blocks) == 2 and len(dev) == 1, blocks  # the lean install and the development one
    commands = [c.split("#")[0].strip() for c in dev[0].splitlines() if c.split("#")[0].strip()]
    assert commands and all(c in ci for c in commands), (commands, ci)
    lean = [c.split("#")[0].strip() for b in blocks if b not in dev for c in b.splitlines() if c.split("#")[0].strip()]
    assert lean and all(c.endswith("pip install -e .") for c in lean), lean
    first_test = tests["code"].splitlines()[0].split("#")[0].strip()
    assert first_test in ci, (first_test, ci)
