"""Dependencies point one way (docs/internals.md, "Where things live"): attention <- run <- primal_dt <- agents <- eval,
and
envs is independent of models. Every import in the tree (top level or inside a function, absolute
or relative) is read with ``ast`` and checked against that order; entry points, which sit on top
and only wire, are excepted by name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("primal_dt", "agents", "eval", "envs")

# rank of each layer: a module may import layers of its own rank or lower
# (primal_dt.run, the run infrastructure both trainers share, reads only the attention registry below it)
RANKS = {"primal_dt.attention": 0, "primal_dt.run": 1, "primal_dt": 2, "agents": 3, "eval": 4}
MODELS = tuple(RANKS)  # what envs may not import: it is independent of models (anyone may import envs)

# Entry points sit on top of every layer and only wire it together (a ``__main__`` module always is
# one): they may import any layer, and being on top, only the top layer (eval) may import them.
ENTRY_POINTS = ("primal_dt.train", "primal_dt.classify")
TOP = "eval"

# The one option grammar (what entry points share lives once), the one error convention, the one
# directory lock, the one atomic writer, the one bounded JSON reader and the progress bar serve envs too (envs.collect,
# envs.behavior, the HDF5 and Minari provenance). envs may import them only
# while they import nothing from the project but each other: then envs still depends on no model code.
# Any other envs -> primal_dt import stays a violation.
ENVS_MAY_IMPORT = ("primal_dt.run.cli", "primal_dt.run.errors", "primal_dt.run.lock", "primal_dt.run.json_reader",
                   "primal_dt.run.checkpoint", "primal_dt.run.progress")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str, entry_points=()) -> str | None:
    """The layer a dotted module name belongs to (the longest matching prefix), or None (third party);
    an entry point counts as the top layer."""
    if module in entry_points or module.split(".")[-1] == "__main__":
        return TOP
    best = None
    for name in (*RANKS, "envs"):
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


def imports(path: Path, root: Path) -> list[tuple[int, str, str]]:
    """(line, imported module, source text) for every import in ``path``; relative imports resolved.
    ``from pkg import name`` counts as ``pkg.name`` when that is a module of the tree."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        text = " ".join((ast.get_source_segment(source, node) or "").split())
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, text) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                is_module = (root / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (root / Path(*sub.split("."))).is_dir()
                found.append((node.lineno, sub if is_module else target, text))
    return sorted(set(found))


def project_imports(path: Path, root: Path) -> list[str]:
    """The modules of the tree that ``path`` imports."""
    return [target for _, target, _ in imports(path, root) if target.split(".")[0] in PACKAGES]


def envs_may_import(root: Path) -> set[str]:
    """The modules of ENVS_MAY_IMPORT that exist in ``root`` and import no project module outside that set."""
    path = lambda m: (root / Path(*m.split("."))).with_suffix(".py")  # noqa: E731
    return {m for m in ENVS_MAY_IMPORT if path(m).exists()
            and set(project_imports(path(m), root)) <= set(ENVS_MAY_IMPORT)}


def violations(root: Path, entry_points=ENTRY_POINTS) -> list[str]:
    """Every import against the direction, as 'file:line: module imports X (`source`)'."""
    out = []
    for_envs = envs_may_import(root)
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            module = module_name(path, root)
            if module in entry_points or path.stem == "__main__":
                continue
            mine = layer(module)
            for line, target, text in imports(path, root):
                theirs = layer(target, entry_points)
                if theirs is None or theirs == "envs":
                    continue  # third-party, or envs (which anyone may import)
                if mine == "envs":
                    bad = theirs in MODELS and target not in for_envs
                    why = "envs is independent of models"
                else:
                    bad = RANKS[theirs] > RANKS[mine]
                    why = f"{mine} (rank {RANKS[mine]}) may not import {theirs} (rank {RANKS[theirs]})"
                if bad:
                    out.append(f"{path.relative_to(root)}:{line}: {module} imports {target} ({why}): {text}")
    return out


def test_imports_point_one_way():
    bad = violations(ROOT)
    assert not bad, ("imports against attention <- primal_dt <- agents <- eval (envs apart); move the code to the "
                     "room it belongs in:\n" + "\n".join(bad))


def test_the_checker_flags_every_kind_of_violation(tmp_path):
    """The check is not vacuous: a tree with one violation of each kind is caught, file and line."""
    files = {
        "primal_dt/__init__.py": "",
        "primal_dt/attention/__init__.py": "",
        "primal_dt/attention/mech.py": "import torch\nfrom ..blocks import Stack\n",        # attention -> core
        "primal_dt/blocks.py": "from .attention import mech\nStack = 1\n",                    # fine
        "primal_dt/core.py": "def f():\n    from agents.policy import P\n",                   # core -> agents, in a function
        "primal_dt/train.py": "import eval.report\n",                                         # entry point: excepted
        "primal_dt/tool/__main__.py": "import eval.report\n",                                 # __main__: excepted
        "agents/__init__.py": "",
        "agents/policy.py": "from eval import report\nimport envs\nfrom primal_dt import blocks\nP = 1\n",
        "agents/cli.py": "from primal_dt.train import run\n",                                 # importing an entry point
        "eval/__init__.py": "",
        "eval/report.py": "from agents.policy import P\nfrom primal_dt.attention import mech\n",  # fine
        "envs/__init__.py": "",
        "envs/sim.py": "import numpy\nfrom agents import policy\n",                          # envs -> models
        "envs/tool.py": "from primal_dt.run.cli import parse\nfrom primal_dt import blocks\n",     # the grammar: fine
        "primal_dt/run/cli.py": "import sys\n",
        "primal_dt/run/options.py": "from ..attention import mech\nfrom ..blocks import Stack\n",  # run -> core
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    bad = violations(tmp_path)
    assert [b.split(":")[0] + ":" + b.split(":")[1] for b in bad] == [
        "primal_dt/attention/mech.py:2", "primal_dt/core.py:2", "primal_dt/run/options.py:2", "agents/cli.py:1",
        "agents/policy.py:1", "envs/sim.py:2", "envs/tool.py:2"]
    assert "from ..blocks import Stack" in bad[0] and "may not import primal_dt (rank 2)" in bad[0]
    assert "agents.policy" in bad[1] and "primal_dt.blocks" in bad[2]
    assert "primal_dt.train" in bad[3] and "eval.report" in bad[4]
    assert "envs is independent of models" in bad[5]
    # without the exception, the entry point is a violation too
    assert any(b.startswith("primal_dt/train.py:1") for b in violations(tmp_path, entry_points=()))
    # the grammar stops being envs' to import once it imports the project
    (tmp_path / "primal_dt/run/cli.py").write_text("import sys\nfrom ..attention import mech\n")
    assert any(b.startswith("envs/tool.py:1") and "envs is independent of models" in b for b in violations(tmp_path))


def test_what_envs_uses_of_primal_dt_imports_nothing_else_of_the_project():
    """primal_dt.run.cli, errors, lock and json_reader are envs' only ways into primal_dt, which holds only while they import
    no project module but each other."""
    for name in ENVS_MAY_IMPORT:
        path = (ROOT / Path(*name.split("."))).with_suffix(".py")
        assert path.exists() and set(project_imports(path, ROOT)) <= set(ENVS_MAY_IMPORT), (
            name, project_imports(path, ROOT))


def import_circles(root: Path) -> list[list[str]]:
    """The sets of the tree's modules that import each other round a circle (strongly connected components of
    the import graph, imports inside functions included): each is a room split wrongly or a dependency that
    points the wrong way, whatever the ranks say."""
    modules = {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))}

    def known(target: str) -> str:  # ``from pkg.mod import name``: the module, not the name
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    graph = {m: {known(t) for t in project_imports(p, root)} - {"", m} for m, p in modules.items()}
    index, low, stack, circles = {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_no_modules_import_each_other_round_a_circle(tmp_path):
    assert import_circles(ROOT) == [], "import circles (a function-level import is one too): move the shared code"
    pkg = tmp_path / "eval"
    pkg.mkdir()
    (pkg / "a.py").write_text("from eval.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from eval import a\n")  # the circle a function hides
    (pkg / "c.py").write_text("from eval.a import f\n")
    assert import_circles(tmp_path) == [["eval.a", "eval.b"]]
