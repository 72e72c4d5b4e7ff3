"""The repository's text cites nothing a reader of the repository cannot open: no notes kept outside
it (the team's design and reference files) and no machine-dated figures in presets, whose ``source``
every run prints. Facts a preset takes from a paper name the paper."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ("DESIGN" + ".md", "REFERENCE" + ".md")  # spelt apart so this file does not match itself
SUFFIXES = {".py", ".yaml", ".md", ".toml", ".cfg", ".txt"}


def tracked_text_files():
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and path.suffix in SUFFIXES and not any(p.startswith(".") or p in ("runs", "data")
                                                                   for p in rel.parts[:-1]):
            yield rel, path


def test_no_file_cites_notes_outside_the_repository():
    cited = [f"{rel}:{i}" for rel, path in tracked_text_files() if rel != Path(__file__).relative_to(ROOT)
             for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if any(name in line for name in OUTSIDE)]
    assert cited == []


def test_preset_sources_carry_no_dated_machine_figures():
    dated = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d+-core\b|this machine|\bEPYC\b")
    presets = sorted((ROOT / "configs").rglob("*.yaml"))
    assert len(presets) >= 40
    bad = [str(p.relative_to(ROOT)) for p in presets if dated.search(str(yaml.safe_load(p.read_text()).get("source", "")))]
    assert bad == []


README_LINES = 200
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
"""the user-facing docs: the README, read first, and the reference it links to, one file per topic"""


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``#`` line in a bash block is no heading, a link
    written in a code block no link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose(path.read_text()), flags=re.M)}


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Relative links of a Markdown file (``[text](target)``, ``target`` a path, a path#anchor or an
    #anchor) whose file or heading is not there."""
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or root not in (dest, *dest.parents):
            bad.append(f"{path.relative_to(root)}: {target} (no such file in the repository)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            bad.append(f"{path.relative_to(root)}: {target} (no heading #{anchor} in {dest.relative_to(root)})")
    return bad


def test_every_relative_link_of_the_readme_and_docs_resolves():
    assert len(DOCS) > 5
    links = sum(len(re.findall(r"\]\(", prose(p.read_text()))) for p in DOCS)
    assert links > 50
    assert [b for p in DOCS for b in broken_links(p)] == []


def test_broken_links_are_found(tmp_path):
    tmp_path = tmp_path / "repo"
    (tmp_path / "docs").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("# Title here\n\n## Two words\n")
    doc = tmp_path / "README.md"
    doc.write_text("# Top\n[ok](docs/a.md) [ok](docs/a.md#two-words) [ok](#top) [web](https://x.org/#y)\n"
                   "[gone](docs/b.md) [bad anchor](docs/a.md#three) [bad own](#bottom) [outside](../x.md)\n"
                   "```bash\n# not a heading: [code](nowhere.md)\n```\n")
    (tmp_path.parent / "x.md").write_text("")
    bad = broken_links(doc, tmp_path)
    assert [b.split(": ")[1].split(" ")[0] for b in bad] == ["docs/b.md", "docs/a.md#three", "#bottom", "../x.md"]


def test_the_readme_is_read_in_five_minutes():
    """The README is the newcomer's page, at most 200 lines; the reference lives in docs/."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines; move reference material to docs/"


def test_readme_opens_with_the_newcomers_path_then_the_documentation():
    """Setup, first run, main command and tests come first, so a newcomer reads them first; the list
    of docs ends it."""
    headings = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), flags=re.M)
    assert headings == ["Setup", "First run", "Main command", "Tests", "Where results are", "Documentation"]


def test_every_measured_result_file_names_its_command_and_machine():
    """Measured tables live in docs/results/, each headed by the command that produced it and the
    machine it ran on, and every one is linked from the docs."""
    results = sorted((ROOT / "docs" / "results").glob("*.md"))
    assert len(results) >= 5
    linked = {(p.parent / t.partition("#")[0]).resolve() for p in DOCS
              for t in re.findall(r"\]\(([^)#\s]+)[^)]*\)", prose(p.read_text()))}
    for path in results:
        head = path.read_text().split("\n|", 1)[0]  # the text above its first table
        assert re.search(r"^Commands?\b|^Policy:|^Command \(", head, flags=re.M), f"{path.name}: no command"
        assert "Machine:" in head or "machine" in head.lower(), f"{path.name}: no machine"
        assert path.resolve() in linked, f"{path.name} is linked from no doc"


def test_every_module_function_and_file_the_docs_name_exists():
    """A module, function or file the README or a doc points a reader to is there (options such as
    ``eval.every`` aside): renaming or removing one without the docs is a failure, not a dead reference."""
    import dataclasses
    import importlib

    from agents import train_config

    text = "\n".join(p.read_text() for p in DOCS)
    option_names = set(train_config.flat(dataclasses.asdict(train_config.TrainConfig())))
    missing = []
    for name in sorted(set(re.findall(r"`((?:agents|envs|eval|primal_dt)(?:\.\w+)+)`", text)) - option_names):
        parts = name.split(".")
        obj = importlib.import_module(parts[0])
        for i, attr in enumerate(parts[1:], 2):  # a submodule is imported, then read like any attribute
            here = ROOT / Path(*parts[:i])
            if not hasattr(obj, attr) and (here.with_suffix(".py").exists() or here.is_dir()):
                importlib.import_module(".".join(parts[:i]))
            obj = getattr(obj, attr, None)
        if obj is None:
            missing.append(name)
    py_files = {p.name for p in ROOT.rglob("*.py")} | {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")}
    missing += [f for f in sorted(set(re.findall(r"`([\w/]+\.py)`", text))) if f not in py_files]
    assert missing == []
