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


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_to_its_own_sections_resolve():
    text = (ROOT / "README.md").read_text()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # headings only outside code blocks
    anchors = {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}
    links = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert links and links <= anchors, sorted(links - anchors)


def test_readme_opens_with_the_newcomers_path_then_its_contents():
    """Setup, first run, main command and tests come before the reference part, so a newcomer reads
    them first; the contents list opens the reference."""
    headings = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), flags=re.M)
    assert headings[:6] == ["Setup", "First run", "Main command", "Tests", "Where results are", "Contents"]


def test_every_module_function_and_file_the_readme_names_exists():
    """A module, function or file the README points a reader to is there (options such as ``eval.every``
    aside): renaming or removing one without the README is a failure, not a dead reference."""
    import dataclasses
    import importlib

    from primal_dt import train_config

    text = (ROOT / "README.md").read_text()
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
