"""One option grammar for every entry point (primal_dt.cli): spellings, lists, booleans, mistakes, --help of
every ``python -m`` command in a real subprocess, and the options training's evaluation shares with eval.rollout."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from primal_dt.cli import Parser, expand_shorthands, find_value, option, parse

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Inner:
    """A nested group of options."""

    rate: float = 0.5
    """a rate"""
    ids: tuple[int, ...] = (1, 2)
    """some ids"""


@dataclass
class Demo:
    name: str = "x"
    """a name"""
    count: int = 3
    """how many"""
    targets: tuple[float, ...] = ()
    """return targets"""
    flag: bool = False
    """a switch"""
    maybe: int | None = None
    """an optional number"""
    specs: tuple[str, ...] = option(("a:k=1,j=2",), spaced=True)
    """specs whose elements hold commas"""
    secret: str = option("", hidden=True)
    """what a command passes its children"""
    inner: Inner = field(default_factory=Inner)


@dataclass
class Files:
    paths: tuple[str, ...] = option(positional=True, metavar="PATH")
    """files to read"""
    out: str = "report"
    """where to write"""


def demo(*argv: str) -> Demo:
    return parse(Demo, argv, prog="python -m demo")


def usage_error(capsys, cls, argv, **kw) -> str:
    """The stderr of a command line the parser refuses (usage, one error line, exit status 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        parse(cls, argv, prog="python -m demo", **kw)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: python -m demo [-h]"), err
    assert len(err.strip().splitlines()) == 2 and "Traceback" not in err
    return err.strip().splitlines()[1]


# -- the grammar ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["targets=3600,1800"], ["targets=[3600,1800]"], ["targets=[3600, 1800]"], ["targets=(3600,1800)"],
    ["targets=3600 1800"], ["--targets", "3600", "1800"], ["--targets=3600,1800"], ["--targets", "3600,1800"],
    ["--targets", "[3600,", "1800]"], ["targets=3600,", "count=3"], ["targets=1", "--targets", "3600", "1800"],
])
def test_every_spelling_of_a_list_is_the_same_list(argv):
    assert demo(*argv).targets == ((3600.0,) if argv == ["targets=3600,", "count=3"] else (3600.0, 1800.0))


def test_negative_numbers_are_values_never_options():
    c = demo("--targets", "-100", "-1e3", "--count", "-2", "inner.ids=-1,-2")
    assert (c.targets, c.count, c.inner.ids) == ((-100.0, -1000.0), -2, (-1, -2))
    assert demo("targets=-inf,nan").targets[0] == float("-inf")  # read here; ranges are the command's check


@pytest.mark.parametrize("word, value", [*[(w, True) for w in ("true", "True", "yes", "on", "1")],
                                         *[(w, False) for w in ("false", "FALSE", "no", "off", "0")]])
def test_booleans_in_every_spelling(word, value):
    assert demo(f"flag={word}").flag is value and demo("--flag", word).flag is value and \
        demo(f"--flag={word}").flag is value


def test_a_flag_alone_is_true_and_the_next_option_is_not_its_value():
    assert demo("--flag").flag is True
    c = demo("--flag", "count=7", "--flag", "--name", "y")
    assert (c.flag, c.count, c.name) == (True, 7, "y")


def test_names_nesting_optional_values_spaced_lists_and_the_last_word():
    c = demo("--inner.rate", "0.25", "inner.ids=[4,5,6]", "maybe=none", "name=a", "--name=b")
    assert (c.inner.rate, c.inner.ids, c.maybe, c.name) == (0.25, (4, 5, 6), None, "b")
    assert demo("maybe=4").maybe == 4 and demo("--inner-rate" if False else "--inner.rate=1").inner.rate == 1.0
    assert demo("--specs", "a:k=1,j=2", "b").specs == ("a:k=1,j=2", "b")  # commas stay inside an element
    assert demo('specs=[a:k=1,j=2 "b"]').specs == ("a:k=1,j=2", "b")
    assert demo("targets=").targets == () and demo("targets=[]").targets == ()
    assert demo("secret=s").secret == "s"  # hidden from --help, still an option


def test_dashes_and_underscores_are_alike_in_names():
    @dataclass
    class Bench:
        step_width: int = 4
        reward_scale: float = 1.0

    b = parse(Bench, ["--step-width", "8", "reward-scale=2", "--reward_scale=3"])
    assert (b.step_width, b.reward_scale) == (8, 3.0)


def test_defaults_come_from_the_given_instance_and_given_lists_what_the_command_line_set():
    base = Demo(count=9, inner=Inner(rate=0.1))
    p = Parser(Demo, default=base)
    c = p.parse(["--targets", "1", "2", "flag=yes"])
    assert (c.count, c.inner.rate, c.targets, c.flag) == (9, 0.1, (1.0, 2.0), True)
    assert p.given(["--targets", "1", "2", "flag=yes", "inner.rate=3"]) == ["targets", "flag", "inner.rate"]


def test_aliases_name_the_same_option():
    p = Parser(Demo, aliases={"eval.targets": "targets", "n": "count"})
    assert p.parse(["eval.targets=[5,6]", "--n", "2"]) == p.parse(["targets=5,6", "count=2"])
    with pytest.raises(TypeError, match="aliases name options Demo does not have: nothing"):
        Parser(Demo, aliases={"x": "nothing"})


def test_bare_words_fill_the_positional_option():
    f = parse(Files, ["a", "b,c", "out=o", "--", "out=literal"])
    assert f.paths == ("a", "b,c", "out=literal") and f.out == "o"


def test_a_command_that_hands_on_what_it_does_not_know():
    p = Parser(Demo, rest="another command")
    cfg, rest = p.parse_known(["count=2", "lrr=0.1", "--eval.targets", "1", "2", "--flag", "--other", "x=1"])
    assert cfg.count == 2 and cfg.flag is True
    assert rest == ["lrr=0.1", "--eval.targets", "1", "2", "--other", "x=1"]


# -- mistakes -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["cont=3"], "unknown option 'cont'; did you mean count?"),
    (["--inner.rat", "1"], "unknown option 'inner.rat'; did you mean inner.rate?"),
    (["rate=1"], "unknown option 'rate'; did you mean inner.rate?"),  # the leaf of a nested option
    (["zzzz=1"], "unknown option 'zzzz' (python -m demo --help lists every option)"),
    (["targets=1,x,3"], "targets: element 2 of 3, 'x', is not a number; lists are written targets=3600,1800, "
                        "targets=[3600,1800] or --targets 3600 1800"),
    (["--inner.ids", "1", "2.5"], "inner.ids: element 2 of 2, '2.5', is not an integer"),
    (["count=many"], "count: 'many' is not an integer"),
    (["count=1.5"], "count: '1.5' is not an integer"),
    (["inner.rate=fast"], "inner.rate: 'fast' is not a number"),
    (["flag=maybe"], "flag: 'maybe' is not true or false"),
    (["--count"], "--count needs a value (INT)"),
    (["--count", "--flag"], "--count needs a value (INT)"),
    (["--targets"], "--targets needs a value: e.g. targets=3600,1800"),
    (["stray"], "argument 'stray' is neither key=value nor --key value"),
    (["=3"], "argument '=3' has an empty key; write key=value"),
])
def test_a_mistake_is_the_usage_and_one_line_naming_it(capsys, argv, message):
    line = usage_error(capsys, Demo, argv)
    assert line.startswith("python -m demo: error: ") and message in line, line


def test_a_required_option_says_how_to_give_it(capsys):
    assert "paths is required: give PATH (files to read)" in usage_error(capsys, Files, [])

    @dataclass
    class Needs:
        checkpoint: str = option(metavar="PATH")
        """the file"""

    assert "checkpoint is required: give checkpoint=PATH (the file)" in usage_error(capsys, Needs, [])


def test_unsupported_types_fail_when_the_parser_is_built():
    @dataclass
    class Pair:
        xy: tuple[int, int] = (1, 2)

    with pytest.raises(TypeError, match=r"option xy: write tuple\[X, \.\.\.\]"):
        Parser(Pair)


# -- --help ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_shows_usage_grammar_and_every_option_with_default_and_docstring(capsys, flag):
    with pytest.raises(SystemExit) as exit_:
        parse(Demo, ["count=nonsense", flag], prog="python -m demo", description="A demo command.")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert out.startswith("usage: python -m demo [-h] [KEY=VALUE ...]\n") and "A demo command." in text
    assert "key=value, --key value or --key=value" in text and "targets=[3600,1800] or --targets 3600 1800" in text
    for spelled, doc, default in (("name=STR", "a name", "x"), ("count=INT", "how many", "3"),
                                  ("targets=FLOAT,...", "return targets", "empty"), ("flag=BOOL", "a switch", "false"),
                                  ("maybe=INT|none", "an optional number", "none"),
                                  ("specs=STR ...", "specs whose elements hold commas", "a:k=1,j=2"),
                                  ("inner.rate=FLOAT", "a rate", "0.5"), ("inner.ids=INT,...", "some ids", "1,2")):
        assert re.search(rf"{re.escape(spelled)} +{re.escape(doc)} \(default: {re.escape(default)}\)", text), spelled
    assert "inner.*: A nested group of options." in text and "secret" not in text


def test_flag_style_help_and_the_argparse_error_hook(capsys):
    @dataclass
    class Bench:
        step_width: int = 4
        """width"""
        K: int = 20
        """context"""
        no_hf: bool = False
        """skip it"""

    p = Parser(Bench, prog="python -m demo", flags=True)
    text = " ".join(p.format_help().split())
    assert "usage: python -m demo [-h] [--KEY VALUE ...]" in text and "--step-width INT width (default: 4)" in text
    assert "-K INT context (default: 20)" in text and "--no-hf [BOOL] skip it (default: false)" in text
    with pytest.raises(SystemExit) as exit_:
        p.error("--step-width must be >= 1, got 0")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "python -m demo: error: --step-width must be >= 1, got 0" in err


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


def test_the_entry_points_are_found():
    names = {" ".join(e) for e in entry_points()}
    assert {"primal_dt.train", "primal_dt.classify", "eval.rollout", "eval.spectrum", "eval.report", "eval.sweep",
            "envs.collect", "envs.behavior", "eval.bench.inference", "eval.bench.attention", "eval.bench.data",
            "eval.bench.train", "eval.bench.classify", "primal_dt.tasks", "primal_dt.tasks listops"} <= names


@pytest.mark.parametrize("command", entry_points(), ids=" ".join)
def test_help_works_for_every_entry_point(command):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", *command, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"usage: python -m {' '.join(command)} "), p.stdout[:200]
    assert "KEY=VALUE" in p.stdout or "--KEY VALUE" in p.stdout
    if command != ("primal_dt.tasks",):  # the tools' index; each tool has its own options
        text = " ".join(p.stdout.split())
        assert "key=value" in text and "lists as" in text and "(default: " in text


# -- what training's evaluation and eval.rollout share ---------------------------------------------------
def test_training_evaluation_and_rollout_share_names_types_defaults_and_docs():
    from eval.rollout import ALIASES, PROG, RolloutConfig, evaluate
    from primal_dt.train_config import RolloutOptions, TrainConfig

    shared = {f.name: f for f in dataclasses.fields(RolloutOptions)}
    assert {"targets", "num_envs", "max_steps", "engine"} <= set(shared)
    training = {f.name: f for f in dataclasses.fields(TrainConfig().eval)}
    rollout = {f.name: f for f in dataclasses.fields(RolloutConfig)}
    for name, f in shared.items():
        for where in (training, rollout):
            assert (where[name].type, where[name].default) == (f.type, f.default), name
    t, r = Parser(TrainConfig).by_name, Parser(RolloutConfig).by_name
    for name in shared:
        assert dataclasses.astuple(t[f"eval.{name}"])[1:] == dataclasses.astuple(r[name])[1:], name
    assert t["device"].default == r["device"].default and t["threads"].default == r["threads"].default
    assert inspect.signature(evaluate).parameters["options"].default == RolloutOptions()  # the library call too
    # the defaults the issue settled: the papers' protocol, 50 simulators (never more than episodes), auto device
    assert (r["engine"].default, r["num_envs"].default, r["device"].default) == ("recompute", 50, "auto")
    # one name per thing: training's spelling works in the rollout command too
    a = parse(RolloutConfig, ["checkpoint=x", "eval.targets=3600,1800", "--eval.engine", "stream"], prog=PROG,
              aliases=ALIASES)
    b = parse(RolloutConfig, ["checkpoint=x", "targets=[3600,1800]", "engine=stream"], prog=PROG, aliases=ALIASES)
    assert a == b and a.targets == (3600.0, 1800.0)


@pytest.mark.parametrize("spelling", [["eval.targets=3600,1800"], ["eval.targets=[3600,1800]"],
                                      ["--eval.targets", "3600", "1800"], ["eval.targets=3600 1800"]])
def test_the_issue_spellings_in_training_and_rollout(spelling):
    from eval.rollout import ALIASES, RolloutConfig
    from primal_dt.train_config import build

    assert build(spelling).cfg.eval.targets == (3600.0, 1800.0)
    assert parse(RolloutConfig, ["checkpoint=x", *spelling], aliases=ALIASES).targets == (3600.0, 1800.0)


# -- helpers for values read before parsing --------------------------------------------------------------
def test_shorthands_and_find_value_in_every_spelling():
    short = {"model": "model.name", "attention": "model.name"}
    assert expand_shorthands(["model=dt", "--attention", "linear", "--model=primal+dt", "seed=1"], short) == \
        ["model.name=dt", "model.name=linear", "model.name=primal+dt", "seed=1"]
    with pytest.raises(ValueError, match="--model needs a value"):
        expand_shorthands(["--model"], short)
    for argv in (["env=a"], ["--env", "a"], ["--env=a"], ["env=b", "--env", "a"]):
        assert find_value(argv, "env") == "a"
    assert find_value(["seed=1"], "env") is None
