"""What option values every command accepts (finite numeric ranges, sizes, devices, output paths,
``attention_options`` words) and the options both trainers share, checked before any work: a bad value is
one line naming the option."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import math
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import did_you_mean, name_too_long, path_line


@dataclass(frozen=True)
class Range:
    """Finite numbers between ``low`` and ``high``, each bound included unless ``*_open``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, x: float) -> bool:
        return (math.isfinite(x) and (self.low is None or (x > self.low if self.low_open else x >= self.low))
                and (self.high is None or (x < self.high if self.high_open else x <= self.high)))

    def __str__(self) -> str:
        lo, hi = (None if x is None else (str(int(x)) if float(x).is_integer() else f"{x:g}")
                  for x in (self.low, self.high))
        if lo is not None and hi is not None:
            return f"in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        if lo is not None:
            return f"{'>' if self.low_open else '>='} {lo}"
        if hi is not None:
            return f"{'<' if self.high_open else '<='} {hi}"
        return "finite"


def check_output_dir(path: str | None, option: str = "out") -> None:
    """Refuse an empty ``out=``: it would mean the current directory, or a default folder other commands read; and
    a name no file system takes now, not after the data is read (``errors.main`` says the same of any path later)."""
    if path is not None and not str(path).strip():
        raise ValueError(f"{option}= is empty: give the directory to write into (leave {option}= out for the "
                         "default)")
    if path is not None and name_too_long(str(path)):
        raise ValueError(path_line(f"{option}=", str(path), errno.ENAMETOOLONG))


def check_output_file(path: str, option: str) -> None:
    """A ValueError now, not after the whole run, when the file ``option`` names cannot be written."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{option}={path} is a directory; give a file name, e.g. {option}={p / 'bench.json'}")
    parent = p.parent
    if not parent.is_dir():
        raise ValueError(f"{option}={path}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option}={path}: the folder {parent} cannot be written")



ANY = Range()
AT_LEAST_0 = Range(0)
AT_LEAST_1 = Range(1)
POSITIVE = Range(0, low_open=True)
FRACTION = Range(0, 1, high_open=True)
SEED = Range(0, 2**32, high_open=True)
"""what every seeded generator (torch, numpy, Gymnasium's reset) accepts"""
THREADS = Range(0, 4096)
"""torch CPU threads (0: ``set_threads`` chooses); torch overflows far above it"""


def check_number(option: str, value, rule: Range, integer: bool = False) -> None:
    """Raise ValueError ``"<option> must be <rule>, got <value>"`` unless ``value`` is a number (a tuple option:
    numbers) within ``rule`` (an integer if ``integer``); None (unset) passes."""
    if value is None:
        return
    if integer and not (isinstance(value, int) and not isinstance(value, bool)):
        raise ValueError(f"{option} must be an integer, got {value!r}")
    values = value if isinstance(value, (tuple, list)) else (value,)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and rule.holds(float(v)) for v in values):
        return
    if isinstance(value, (tuple, list)):
        raise ValueError(f"{option} must hold numbers that are {rule}, got {', '.join(map(str, values))}")
    raise ValueError(f"{option} must be {rule}, got {value!r}" if rule != ANY
                     else f"{option} must be a finite number, got {value!r}")


def check_numbers(cfg, rules: Mapping[str, Range], prefix: str = "") -> None:
    """``check_number`` for each (dotted) option of ``cfg`` in ``rules``, an integer where the field says
    ``int`` (a config made in code may hold 2.5); ``prefix``: where ``cfg`` sits on its command line."""
    for name, rule in rules.items():
        *parents, leaf = name.split(".")
        owner = functools.reduce(getattr, parents, cfg)
        hint = typing.get_type_hints(type(owner)).get(leaf) if dataclasses.is_dataclass(owner) else None
        check_number(prefix + name, getattr(owner, leaf), rule, integer=hint is int)


MAX_VALUES = 2**33
"""about 34 GB of float32: more weights (or activations of one step) than that is a typo, not a model"""


def check_size(values: float, options: str, what: str = "parameters") -> None:
    """Refuse sizes no machine can build (d_model=10**9 would hang in allocation): ``values`` float32 numbers
    asked for by ``options``."""
    if values > MAX_VALUES:
        raise ValueError(f"{options} need about {values:.3g} {what} ({4 * values / 2**30:.3g} GB of float32), more "
                         f"than the {MAX_VALUES:.3g} this accepts; lower them")


def check_device(name: str, option: str = "device") -> None:
    """Reject a misspelt device before anything runs (whether CUDA exists is ``pick_device``'s call)."""
    if not (name in ("auto", "cpu") or name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit())):
        raise ValueError(f"{option} must be auto, cpu, cuda or cuda:N, got {name!r}")


def attention_options(words: Sequence[str] | str, option: str = "attention_options",
                      defaults: dict[str, dict] | None = None) -> dict[str, dict]:
    """{mechanism: {option: value}} from ``mechanism.option=value`` words, each typed by the constructor's
    annotation; ``defaults`` (options with their own flags: ``model.s``) fill what the words leave out."""
    from ..attention import available
    from ..attention.registry import constructor_options

    words = as_words(words)
    known, opts = available(), {}
    for word in words:
        key, eq, text = word.partition("=")
        mechanism, dot, name = key.strip().rpartition(".")
        if not (eq and dot and mechanism and name):
            raise ValueError(f"{option}: {word!r} is not mechanism.option=value; write e.g. {option}=softmax.window=30")
        if mechanism not in known:
            raise ValueError(f"{option}: unknown attention mechanism {mechanism!r}.{did_you_mean(mechanism, known)} "
                             f"Known: {', '.join(known)}")
        accepted = constructor_options(mechanism)
        if name not in accepted:
            raise ValueError(f"{option}: attention {mechanism!r} does not accept option {name!r}."
                             f"{did_you_mean(name, accepted, n=2)} Accepted: {', '.join(accepted)}")
        opts.setdefault(mechanism, {})[name] = _typed(text.strip(), accepted[name], f"{option}: {key.strip()}")
    for mechanism, values in (defaults or {}).items():
        opts[mechanism] = {**values, **opts.get(mechanism, {})}
    return opts


def attention_words(options: Mapping[str, Mapping]) -> tuple[str, ...]:
    """``attention_options`` words for {mechanism: {option: value}}."""
    return tuple(f"{m}.{k}={'none' if v is None else v}" for m, values in options.items() for k, v in values.items())


def as_words(value: Sequence[str] | str) -> tuple[str, ...]:
    """``attention_options`` as a tuple of words (a saved config gives a list, code may give one string)."""
    return tuple(w for w in ((value,) if isinstance(value, str) else value) if w.strip())


def _typed(text: str, annotation, where: str):
    """``text`` as the annotation's type: int, float, bool (true/false), str, or ``X | None`` (none)."""
    args = typing.get_args(annotation)
    if type(None) in args:
        if text.lower() == "none":
            return None
        annotation = next(a for a in args if a is not type(None))
    if annotation is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{where} must be true or false, got {text!r}")
        return text.lower() == "true"
    if annotation in (int, float):
        try:
            return annotation(text)
        except ValueError:
            raise ValueError(f"{where} must be {'an integer' if annotation is int else 'a number'}, got {text!r}") \
                from None
    if annotation is None:  # unannotated: a number when it reads as one
        for kind in (int, float):
            with contextlib.suppress(ValueError):
                return kind(text)
    return text


@dataclass
class RunOptions:
    """The options both training commands have: one definition, spelt, documented and checked alike."""

    seed: int = 0
    """seeds everything random in the run: weight initialisation, dropout, batches (and evaluation episodes)"""
    out: str = "runs"
    """root of run directories (<out>/<dataset or task>/<model>/<time>-seed<k>/)"""
    resume: str = ""
    """continue a run: its checkpoint, its run directory, or a directory of runs (the newest holding a checkpoint);
    the saved config is used"""
    threads: int = 0
    """torch CPU threads (0: one per process on a CPU of up to 4 cores, else the process's share of the cores)"""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N"""
    progress: bool = True
    """progress bars on a terminal; written to a file or a pipe, a plain progress line a minute instead
    (false: no bars)"""
    tensorboard: bool = True
    """write TensorBoard event files into the run directory"""

    def check(self) -> None:
        check_numbers(self, {"seed": SEED, "threads": THREADS})
        check_output_dir(self.out)
        check_device(self.device)
