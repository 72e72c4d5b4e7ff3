"""The command line of every entry point: tyro reads the config dataclass (``--help`` from field docstrings)
behind a front that only rewrites ``key=value`` to ``--key=value``, ``a,b`` (or ``[a,b]``) to words, ``true``/``false``
to ``--key``/``--no_key``, ``none`` to ``None`` and a shorthand to its option. A mistake exits with status 2.
Imports nothing from the project (``envs`` uses it)."""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

import tyro

T = TypeVar("T")
_KEY = re.compile(r"[A-Za-z_][\w.-]*$")


def fail(message: str) -> NoReturn:
    """End the command for a mistake in its input: one ``error: <message>`` line, exit status 2 (tyro's)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise Mistake(message)


class Mistake(SystemExit):
    """``fail``'s exit: status 2, and the message for whoever catches it (a test, a calling command)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return f"error: {self.message}"


def options(cls: type, prefix: str = "") -> dict[str, str]:
    """{dotted name: bool | list | optional | value} of every option of config dataclass ``cls``."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(options(tp, f"{prefix}{f.name}."))
            continue
        args = typing.get_args(tp)
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
        tp = next(a for a in args if a is not type(None)) if optional else tp
        kind = ("bool" if tp is bool else "list" if typing.get_origin(tp) in (tuple, list)
                else "optional" if optional else "value")
        out[prefix + f.name] = kind
    return out


def rewrite(cls: type, argv: Sequence[str], shorthands: dict[str, str] | None = None,
            strict: bool = True) -> tuple[list[str], list[str]]:
    """(``argv`` as tyro reads it, the dotted names it sets). An unknown ``key=value`` becomes ``--key value``
    when ``strict`` (tyro then names the options it resembles), else ``--key=value`` to be handed on."""
    known, short = options(cls), shorthands or {}
    out: list[str] = []
    given: list[str] = []
    current = None  # the kind of the option whose values follow as words
    for word in argv:
        key, eq, value = word.partition("=")
        name = short.get(key.removeprefix("--").replace("-", "_"), key.removeprefix("--").replace("-", "_"))
        if (word.startswith("--") or (eq and _KEY.match(key))) and name in known:
            given.append(name)
            current = None if eq else known[name]
            out += _option(name, known[name], value) if eq else [f"--{name}"]
        elif current == "bool" and word.lower() in ("true", "false"):
            out[-1] = out[-1] if word.lower() == "true" else _no(out[-1][2:])
            current = None
        elif current and current != "bool" and not word.startswith("--"):
            out += _values(current, word)
            current = current if current == "list" else None
        elif eq and _KEY.match(key.removeprefix("--")):  # (an option word, so that no list takes it in)
            out += [f"--{name}", value] if strict else [f"--{key.removeprefix('--')}={value}"]
            current = None
        else:
            out.append(word)
            current = None
    return out, list(dict.fromkeys(given))


def _option(name: str, kind: str, value: str) -> list[str]:
    """The words tyro reads for ``name=value``."""
    if kind == "bool" and value.lower() in ("true", "false"):
        return [f"--{name}" if value.lower() == "true" else _no(name)]
    return [f"--{name}", *_values(kind, value)] if kind == "list" else [f"--{name}={_values(kind, value)[0]}"]


def _no(name: str) -> str:
    """tyro's flag that sets bool option ``name`` false: ``--no_flag``, ``--group.no_flag`` for a nested one."""
    group, dot, leaf = name.rpartition(".")
    return f"--{group}{dot}no_{leaf}"


def _values(kind: str, text: str) -> list[str]:
    """The words tyro reads for ``text``, a value (or, for a list, some elements) of an option."""
    if kind == "list":
        text = text[1:-1] if text[:1] + text[-1:] == "[]" else text  # [a,b], as YAML and Python write lists
        return [w.strip() for w in text.split(",") if w.strip()]
    return ["None" if kind == "optional" and text.lower() == "none" else text]


def plain(text: str) -> str:
    """Help text as a reader sees it: each paragraph one flowing line (the terminal wraps it), no reStructuredText
    ``literal`` marks. tyro keeps the source's line breaks inside a field's docstring (they come indented, which
    its joining of lines takes for a list), so --help broke lines mid-phrase."""
    return "\n\n".join(" ".join(p.split()).replace("``", "") for p in re.split(r"\n\s*\n", text.strip()))


def _plain_docstrings() -> None:
    """Route tyro's docstring readers through ``plain``; tyro reads them by module attribute when it builds a
    parser. (Private names: a tyro without them keeps its own help text.)"""
    from tyro import _docstrings

    read_fields = getattr(_docstrings, "parse_docstring_from_object", None)
    describe = getattr(_docstrings, "get_callable_description", None)
    if read_fields is None or describe is None or getattr(read_fields, "plain", False):
        return

    def fields(obj):
        return {k: plain(v) for k, v in read_fields(obj).items()}

    def description(f):
        return plain(describe(f))

    fields.plain = description.plain = True
    _docstrings.parse_docstring_from_object, _docstrings.get_callable_description = fields, description


def parse(cls: type[T], argv: Sequence[str], *, default: T | None = None, prog: str | None = None,
          description: str | None = None, shorthands: dict[str, str] | None = None, known: bool = False) -> Any:
    """The config ``argv`` asks for over ``default`` (a preset; ``--help`` shows its values), ``prog`` naming
    the command in ``--help`` and errors. ``known``: return (config, the words this command does not know)."""
    args, _ = rewrite(cls, argv, shorthands, strict=not known)
    _plain_docstrings()
    return tyro.cli(cls, args=args, default=default, prog=prog, description=description and plain(description),
                    use_underscores=True, return_unknown_args=known)


def peek(cls: type[T], argv: Sequence[str], shorthands: dict[str, str] | None = None, prog: str | None = None) -> T:
    """A first reading of ``argv`` for the options that choose a preset or checkpoint (``env``, ``resume``)."""
    args = [a for a in rewrite(cls, argv, shorthands, strict=False)[0] if a not in ("-h", "--help")]
    return tyro.cli(cls, args=args, prog=prog, use_underscores=True, return_unknown_args=True)[0]


def given(cls: type, argv: Sequence[str], shorthands: dict[str, str] | None = None) -> list[str]:
    """Dotted names of the options ``argv`` sets, in order: where a run's values came from."""
    return rewrite(cls, argv, shorthands)[1]

