"""The command line of every entry point (tyro behind primal_dt.run.cli's front): every option recorded before the
move to tyro still exists under its dotted name, the front's spellings give one config, and every mistake ends
alike (exit status 2, no traceback); ``--help`` of every ``python -m`` command in a real subprocess."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from primal_dt.run import cli

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).with_name("cli_options.txt")


def recorded() -> dict[str, dict[str, str | None]]:
    """{entry point: {option: None, shorthand: the option it stands for}} as recorded before tyro."""
    out: dict[str, dict[str, str | None]] = {}
    for line in RECORDED.read_text().splitlines():
        entry, name, *target = line.split()
        out.setdefault(entry.replace(":", " "), {})[name] = target[1] if target else None
    return out


def run(*argv: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def entry_points() -> list[tuple[str, ...]]:
    """Every ``python -m`` command of the tree: modules with a ``__main__`` block, packages with a
    ``__main__.py``, and the tools of ``python -m primal_dt.tasks``."""
    found = []
    for pkg in ("primal_dt", "agents", "eval", "envs"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if path.name == "__main__.py":
                found.append((".".join(parts[:-1]),))
            elif re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M):
                found.append((".".join(parts),))
    from primal_dt.tasks.__main__ import TOOLS

    return found + [("primal_dt.tasks", tool) for tool in TOOLS]


def test_the_entry_points_are_found_and_each_recorded_one_still_exists():
    names = {" ".join(e) for e in entry_points()}
    assert set(recorded()) <= names and "eval.bench.inference" in names


HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback
out = {}
for command in json.loads(sys.argv[1]):
    sys.argv = ["python -m " + command[0], *command[1:], "--help"]
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_module(command[0], run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            code, _ = 1, traceback.print_exc()
    out[" ".join(command)] = [code, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    """{command: [exit status, stdout, stderr]} of every entry point's ``--help``, all run in one real
    subprocess (``runpy``, as ``python -m`` runs a module), so the package is imported once, not per command."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    p = subprocess.run([sys.executable, "-c", HELP_ALL, json.dumps(entry_points())], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


@pytest.mark.parametrize("command", entry_points(), ids=" ".join)
def test_help_works_for_every_entry_point_and_lists_every_recorded_option(command, helps):
    code, stdout, stderr = helps[" ".join(command)]
    assert code == 0 and "Traceback" not in stderr, stderr
    assert stdout.startswith("usage: python -m "), stdout[:200]
    shown = set(re.findall(r"--([A-Za-z_][\w.]*)", stdout)) | {w.lower() for w in re.findall(r"[A-Z]+", stdout)}
    options = [n for n, target in recorded().get(" ".join(command), {}).items() if target is None]
    assert [n for n in options if n not in shown] == [], stdout


# -- the front: the package's spellings in, tyro's words out ---------------------------------------------
@dataclass
class Inner:
    """A nested group."""

    rate: float = 0.5
    """a rate"""
    ids: tuple[int, ...] = (1, 2)
    """some ids"""
    on: bool = True
    """a nested switch"""


@dataclass
class Demo:
    name: str = "x"
    """a name"""
    targets: tuple[float, ...] = ()
    """return targets"""
    flag: bool = False
    """a switch"""
    maybe: int | None = 3
    """an optional number"""
    inner: Inner = field(default_factory=Inner)


def demo(*argv: str) -> Demo:
    return cli.parse(Demo, argv, prog="python -m demo", shorthands={"rate": "inner.rate"})


@pytest.mark.parametrize("argv", [
    ["targets=3600,1800", "flag=true", "maybe=none", "inner.rate=0.25", "inner.ids=4,5"],
    ["--targets", "3600", "1800", "--flag", "--maybe", "none", "--inner.rate", "0.25", "--inner.ids", "4", "5"],
    ["--targets=3600,1800", "--flag=true", "--maybe=None", "--inner.rate=0.25", "--inner.ids=4,5"],
    ["--targets", "3600,1800", "--flag", "true", "rate=0.25", "--inner.ids", "4,5", "--maybe=none"],
    ["targets=[3600,1800]", "flag=true", "maybe=none", "inner.rate=0.25", "inner.ids=[4, 5]"],
])
def test_every_spelling_gives_the_same_config(argv):
    assert demo(*argv) == Demo("x", (3600.0, 1800.0), True, None, Inner(0.25, (4, 5)))


def test_negatives_booleans_empty_lists_and_what_was_given():
    c = demo("--targets", "-100", "-1e3", "inner.ids=-1,-2", "flag=false")
    assert (c.targets, c.inner.ids, c.flag) == ((-100.0, -1000.0), (-1, -2), False)
    assert demo("targets=", "--flag", "false").targets == () and not demo("--flag", "false").flag
    assert not demo("inner.on=false").inner.on and not demo("--inner.on", "false").inner.on  # --inner.no_on
    assert cli.given(Demo, ["rate=1", "--flag", "name=y", "rate=2"], {"rate": "inner.rate"}) == \
        ["inner.rate", "flag", "name"]


def test_the_default_instance_stands_where_nothing_is_given():
    base = Demo(name="preset", inner=Inner(rate=9.0))
    c = cli.parse(Demo, ["inner.ids=7"], default=base)
    assert (c.name, c.inner.rate, c.inner.ids) == ("preset", 9.0, (7,))


def test_a_command_that_hands_on_what_it_does_not_know():
    c, rest = cli.parse(Demo, ["name=a", "lr=3", "--steps", "5", "--flag"], known=True)
    assert (c.name, c.flag, rest) == ("a", True, ["--lr=3", "--steps", "5"])


@pytest.mark.parametrize("argv, shown", [(["nmae=y"], "--name"), (["--flag=maybe"], "maybe"),
                                         (["inner.ids=1,x"], "inner.ids"), (["stray"], "stray")])
def test_a_mistake_tyro_finds_exits_2_naming_it(capsys, argv, shown):
    with pytest.raises(SystemExit) as exit_:
        demo(*argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and shown in err and "Traceback" not in err, err


def test_fail_is_one_error_line_and_exit_status_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.fail("steps must be >= 1, got 0")
    assert exit_.value.code == 2 and str(exit_.value) == "error: steps must be >= 1, got 0"
    assert capsys.readouterr().err == "error: steps must be >= 1, got 0\n"


# -- the convention in real commands ---------------------------------------------------------------------
def test_help_shows_field_docstrings_and_the_presets_values():
    p = run("primal_dt.train", "env=hopper-medium", "--help")
    text = " ".join(p.stdout.split())
    assert p.returncode == 0 and "--model.name" in text and "optimizer steps (default: 100000)" in text, text[:3000]
    assert "--eval.engine {recompute,stream}" in text


@pytest.mark.parametrize("argv, says", [
    (["primal_dt.train", "lrr=3"], "--lr"),  # an unknown option: tyro names the close ones
    (["primal_dt.train", "model.activation=tanh"], "relu"),  # Literal: the names it accepts
    (["primal_dt.train", "steps=0"], "error: steps must be >= 1, got 0"),  # the command's own check
    (["primal_dt.classify", "train.optimizr=sgd"], "train.optimizer"),  # a nested option: the close one named
    (["envs.collect", "level=random"], "medium-replay"),
])
def test_every_kind_of_mistake_exits_2_without_a_traceback(argv, says):
    p = run(*argv)
    assert p.returncode == 2 and says in " ".join(p.stderr.split()) and "Traceback" not in p.stderr, p.stderr


# -- what training's evaluation and eval.rollout share ---------------------------------------------------
def test_training_evaluation_and_rollout_share_names_types_defaults_and_docs():
    from eval.rollout import PROG, SHORTHANDS, RolloutConfig, evaluate
    from agents.train_config import RolloutOptions, TrainConfig

    shared = {f.name: f for f in dataclasses.fields(RolloutOptions)}
    assert {"targets", "num_envs", "max_steps", "engine"} <= set(shared)
    training = {f.name: f for f in dataclasses.fields(TrainConfig().eval)}
    rollout = {f.name: f for f in dataclasses.fields(RolloutConfig)}
    for name, f in shared.items():
        for where in (training, rollout):
            assert (where[name].type, where[name].default) == (f.type, f.default), name
    assert rollout["device"].default == TrainConfig.device and rollout["threads"].default == TrainConfig.threads
    assert inspect.signature(evaluate).parameters["options"].default == RolloutOptions()  # the library call too
    assert (shared["engine"].default, shared["num_envs"].default) == ("recompute", 50)
    # one name per thing: training's spelling works in the rollout command too
    a = cli.parse(RolloutConfig, ["checkpoint=x", "eval.targets=3600,1800", "--eval.engine", "stream"], prog=PROG,
                  shorthands=SHORTHANDS)
    b = cli.parse(RolloutConfig, ["checkpoint=x", "--targets", "3600", "1800", "engine=stream"], prog=PROG,
                  shorthands=SHORTHANDS)
    assert a == b and a.targets == (3600.0, 1800.0)


def test_every_recorded_shorthand_names_the_same_option():
    from eval import rollout, sweep
    from primal_dt import classify_config
    from agents import train_config
    from primal_dt.tasks import listops

    where = {"primal_dt.train": (train_config.TrainConfig, train_config.SHORTHANDS),
             "primal_dt.classify": (classify_config.ClassifyConfig, classify_config.SHORTHANDS),
             "eval.rollout": (rollout.RolloutConfig, rollout.SHORTHANDS),
             "eval.sweep": (sweep.SweepConfig, sweep.ALIASES),
             "primal_dt.tasks listops": (listops.GenerateArgs, listops.SHORTHANDS)}
    for entry, names in recorded().items():
        for short, target in names.items():
            if target is not None:
                cls, shorthands = where[entry]
                assert cli.given(cls, [f"{short}=1"], shorthands) == [target] == cli.given(cls, [f"--{short}", "1"],
                                                                                           shorthands), (entry, short)


def test_an_empty_out_is_refused_by_every_command_that_writes_a_tree():
    """``out=`` (empty) would mean the current directory or a default data folder other runs read from:
    each command that takes a directory refuses it in one message naming the option."""
    from envs.collect import CollectConfig, check as collect_check
    from eval import report, sweep
    from primal_dt.classify_config import ClassifyConfig
    from primal_dt.run.options import RunOptions
    from agents.train_config import TrainConfig

    for cfg in (TrainConfig(out=""), ClassifyConfig(out=" ")):  # the run options both trainers check
        with pytest.raises(ValueError, match="out= is empty"):
            RunOptions.check(cfg)
    with pytest.raises(ValueError, match="out= is empty"):
        sweep.split_args(["out="])
    with pytest.raises(SystemExit) as exc:
        report.main(["runs", "--out="])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        collect_check(CollectConfig(out=""))
    assert exc.value.code == 2


@pytest.mark.parametrize("name", ["../../x", "../dt/smoke", "/etc/passwd", ".hidden", "a/b"])
def test_a_preset_name_is_never_a_path(tmp_path, name):
    from primal_dt.run import presets

    with pytest.raises(ValueError, match="is not a preset name"):
        presets.load_preset("dt", name)


def test_a_new_run_beside_a_running_one_of_the_same_seed_says_so(tmp_path, capfd):
    """Runs never share a directory; a second run of the same dataset, model and seed started while the
    first runs gets one warning line naming the other run's directory and process."""
    from primal_dt.run.monitor import run_dir

    first = run_dir(tmp_path, "hopper-medium", "dt", seed=0)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from primal_dt.run import lock; "
                               f"lock.hold({str(first)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        capfd.readouterr()
        second = run_dir(tmp_path, "hopper-medium", "dt", seed=0)
        (line,) = capfd.readouterr().err.strip().splitlines()
        assert second != first and line.startswith(f"warning: process {holder.pid} is running") and str(first) in line
        run_dir(tmp_path, "hopper-medium", "dt", seed=1)  # another seed: no warning
        assert capfd.readouterr().err == ""
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("module", ["primal_dt.train", "eval.report", "eval.rollout", "eval.sweep"])
def test_help_reads_as_plain_text_its_lines_broken_only_by_the_terminal(module, run_cli):
    """The source's line breaks inside a docstring once broke --help lines mid-phrase (a short line, then the rest
    of the sentence), and its ``literal`` marks and module paths reached the reader. Now every help line but an
    option's last is filled to the box's width, give or take a word."""
    import os

    os.environ["COLUMNS"] = "120"  # the child's rich reads it (run_cli copies the environment)
    try:
        p = run_cli(module, "--help")
    finally:
        del os.environ["COLUMNS"]
    assert p.returncode == 0, p.stderr
    assert "``" not in p.stdout and "agents.stream_training" not in p.stdout and "RUNTIME_OPTIONS" not in p.stdout
    entries, current = [], None  # [option, its help rows]
    for line in p.stdout.splitlines():
        if not line.startswith("│") or set(line) <= set("│─ "):  # a box's border or rule: no option's help
            current = None
        elif line[2] == "-":  # an option: its name, then its help after a gap (or on the rows below)
            name, _, help_text = line[2:].rstrip("│ ").partition("  ")
            current = [name, [help_text.strip()] if help_text.strip() else []]
            entries.append(current)
        elif current is not None:
            current[1].append(line.strip("│ "))
    short = [(name, row) for name, rows in entries for row in rows[:-1] if len(row) < 94 - 30]
    assert entries and not short, short[:3]
