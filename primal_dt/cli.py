"""The one command-line grammar of every entry point: typed config dataclasses read from ``key=value``.

Every ``python -m ...`` command of the package (training, classification, rollout, export, collection,
spectrum, reports, sweeps, benchmarks, data tools) declares its options as a dataclass (CORL's habit:
the configuration is typed data, with a docstring per field) and reads its command line with
``parse``, so that a user learns one spelling:

- ``key=value``, ``--key value`` and ``--key=value``; nested options are dotted (``eval.targets``);
  ``-`` and ``_`` are alike in names (``--reward-scale`` is ``reward_scale``);
- lists: ``a,b``, ``[a,b]``, ``"a b"``, or several words after ``--key`` (``--eval.targets 3600 1800``);
  a negative number is a value, never an option (``eval.targets=-100,50``); an empty value is an
  empty list;
- booleans: true/false, yes/no, on/off, 1/0, and ``--flag`` alone means true;
- optional values (``X | None``): ``none``;
- ``-h`` / ``--help``: the ``python -m`` usage, this grammar, and every option with its type, default
  and docstring.

A mistake ends as argparse's do (the usage, one ``error:`` line, exit status 2): an unknown option
names the closest valid ones, a bad list element says which element and why. Range checks (``K``
must be >= 1) are the entry points' own, after parsing.

This module imports nothing from the project, so ``envs`` (which stands apart from the models) uses
it too; ``tests/test_architecture.py`` holds it to that.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import shutil
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

T = TypeVar("T")

TRUE = ("true", "yes", "on", "1")
FALSE = ("false", "no", "off", "0")
NONE = ("none", "null")
_KINDS = {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR", Path: "PATH"}


def option(default: Any = MISSING, *, spaced: bool = False, positional: bool = False, hidden: bool = False,
           metavar: str = "") -> Any:
    """A dataclass field with command-line details (a plain ``field`` otherwise; no default: required).

    ``spaced``: a list option whose elements may hold commas (benchmark specs such as
    ``primal:s=20,data_dependent=true``), so only spaces separate them. ``positional``: bare words on
    the command line fill this list option (``python -m eval.report RUN ...``). ``hidden``: accepted
    but left out of ``--help`` (an option a command passes to its own child processes)."""
    meta = {"cli": {"spaced": spaced, "positional": positional, "hidden": hidden, "metavar": metavar}}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass
class Option:
    """One command-line option: a leaf field of the config dataclass, by its dotted name."""

    name: str
    kind: type
    """bool | int | float | str | Path: the type of the value, or of each element of a list"""
    many: type | None
    """tuple or list for a list option, None for a single value"""
    optional: bool
    """``X | None``: ``none`` is a value"""
    default: Any
    """MISSING: required"""
    doc: str = ""
    spaced: bool = False
    positional: bool = False
    hidden: bool = False
    metavar: str = ""

    def shape(self) -> str:
        """INT, FLOAT,..., STR|none: how a value of this option is written."""
        one = _KINDS[self.kind]
        text = f"{one},..." if self.many and not self.spaced else f"{one} ..." if self.many else one
        return self.metavar or (f"{text}|none" if self.optional else text)


@dataclass
class Group:
    """A nested config dataclass: its options share the prefix ``name.``."""

    name: str
    doc: str


# -- reading a config dataclass -------------------------------------------------------------------------
def _docs(cls: type) -> tuple[str, dict[str, str]]:
    """(the class's own docstring, {field: docstring}) from the source: the string after each field."""
    own = inspect.getdoc(cls) or ""
    if own.startswith(f"{cls.__name__}("):  # the signature dataclasses writes, not a description
        own = ""
    fields: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for a, b in zip(body, body[1:]):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                fields[a.target.id] = " ".join(b.value.value.split())
    return " ".join(own.split()), fields


def _type(tp: Any, name: str) -> tuple[type, type | None, bool]:
    """(value kind, list container or None, optional) of a field's annotation."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"option {name}: {tp} is not supported (only X | None)")
        tp, optional = args[0], True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    many = None
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"option {name}: write tuple[X, ...], not {tp}")
        many, tp = origin, args[0]
    if tp not in _KINDS:
        raise TypeError(f"option {name}: type {tp} is not supported by primal_dt.cli")
    return tp, many, optional


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _walk(cls: type, base: Any, prefix: str, options: list[Option], groups: list[Group], doc: str = "") -> None:
    own, docs = _docs(cls)
    if prefix:
        groups.append(Group(prefix[:-1], doc or own))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        value = getattr(base, f.name) if base is not None else _default(f)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            _walk(tp, None if value is MISSING else value, f"{prefix}{f.name}.", options, groups, docs.get(f.name, ""))
            continue
        kind, many, optional = _type(tp, prefix + f.name)
        meta = f.metadata.get("cli", {})
        options.append(Option(prefix + f.name, kind, many, optional, value, docs.get(f.name, ""),
                              meta.get("spaced", False), meta.get("positional", False), meta.get("hidden", False),
                              meta.get("metavar", "")))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _norm(key: str) -> str:
    return key.replace("-", "_")


def _show(value: Any) -> str:
    """A default as it would be written on the command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(map(_show, value)) or "empty"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        text = repr(value)
        return text if len(text) <= 12 else f"{value:.6g}"
    return str(value) if value != "" else "''"


def _main_module() -> str:
    """``python -m <module>`` of the running program (a package's ``__main__`` names the package)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return "python -m " + spec.name.removesuffix(".__main__")
    return Path(sys.argv[0]).name or "python"


# -- the parser ---------------------------------------------------------------------------------------------
class Parser(Generic[T]):
    """The command line of one entry point, read into its config dataclass ``cls``.

    ``default``: the instance whose values stand when an option is not given (a preset applied over the
    class defaults; ``--help`` shows these). ``aliases``: other names of options (``{"eval.targets":
    "targets"}``). ``rest``: for commands that hand the options they do not know to another command
    (``eval.sweep`` to training): what receives them, shown in ``--help``; ``parse_known`` returns
    those options as written. ``flags``: show options as ``--name VALUE`` in ``--help`` (benchmarks
    documented that way); every spelling is accepted either way. ``error`` ends the command as
    argparse's ``parser.error`` does, so ``runtime.check_parsed(parser, cfg, rules)`` works with it."""

    def __init__(self, cls: type[T], default: T | None = None, prog: str | None = None,
                 description: str | None = None, *, aliases: dict[str, str] | None = None, rest: str = "",
                 flags: bool = False, epilog: str = ""):
        self.cls, self.default = cls, default
        self.prog = prog or _main_module()
        self.description, self.epilog, self.rest, self.flags = description or "", epilog, rest, flags
        self.options: list[Option] = []
        self.groups: list[Group] = []
        _walk(cls, default, "", self.options, self.groups)
        self.by_name = {o.name: o for o in self.options}
        self.aliases = {_norm(k): v for k, v in (aliases or {}).items()}
        unknown = sorted(set(self.aliases.values()) - set(self.by_name))
        if unknown:
            raise TypeError(f"aliases name options {cls.__name__} does not have: {', '.join(unknown)}")
        self.positional = next((o for o in self.options if o.positional), None)

    # -- public --------------------------------------------------------------------------------------------
    def parse(self, argv: Sequence[str] | None = None) -> T:
        """The config the command line ``argv`` (default ``sys.argv[1:]``) asks for; exits 0 after
        ``--help``, 2 (with the usage and one error line) after a mistake."""
        return self._parse(argv, known_only=False)[0]

    def parse_known(self, argv: Sequence[str] | None = None) -> tuple[T, list[str]]:
        """(config, the options this command does not know, as written): for commands with ``rest``."""
        return self._parse(argv, known_only=True)

    def given(self, argv: Sequence[str]) -> list[str]:
        """Dotted names of the options ``argv`` sets, in order (aliases resolved): where values came from."""
        values, _, _ = self._read(list(argv), known_only=self.rest != "")
        return list(values)

    def error(self, message: str) -> NoReturn:
        """End the command as argparse does: the usage, ``<prog>: error: <message>``, exit status 2."""
        sys.stderr.write(f"{self.usage()}\n{self.prog}: error: {message}\n")
        raise SystemExit(2)

    def usage(self) -> str:
        tail = ""
        if self.positional is not None:
            word = self.positional.metavar or self.positional.name.upper()
            tail = f" {word} [{word} ...]" if self.positional.default is MISSING else f" [{word} ...]"
        return f"usage: {self.prog} [-h] [{'--KEY VALUE' if self.flags else 'KEY=VALUE'} ...]{tail}"

    def format_help(self) -> str:
        width = max(60, min(120, shutil.get_terminal_size((100, 24)).columns))
        out = [self.usage(), ""]
        if self.description:
            out += [self.description.strip(), ""]
        out += textwrap.wrap(self._grammar(), width) + [""]
        out.append("options:")
        out += self._entry("-h, --help", "show this help and exit", width)
        shown = [o for o in self.options if not o.hidden]
        top = sorted((o for o in shown if "." not in o.name), key=lambda o: o.default is not MISSING)  # required first
        out += [line for o in top for line in self._entry(self._spelling(o), self._describe(o), width)]
        for g in self.groups:  # nested configs after the top-level options, one block each
            mine = [o for o in shown if o.name.rpartition(".")[0] == g.name]
            if mine:
                out += ["", *textwrap.wrap(f"{g.name}.*" + (f": {g.doc}" if g.doc else ":"), width)]
                out += [line for o in mine for line in self._entry(self._spelling(o), self._describe(o), width)]
        if self.rest:
            out += ["", *textwrap.wrap(f"Every other option is handed to {self.rest}.", width)]
        if self.epilog:
            out += ["", self.epilog.strip()]
        return "\n".join(out) + "\n"

    # -- reading argv ---------------------------------------------------------------------------------------
    def _parse(self, argv: Sequence[str] | None, known_only: bool) -> tuple[T, list[str]]:
        argv = sys.argv[1:] if argv is None else list(argv)
        raw, positionals, rest = self._read(argv, known_only)
        values = {name: self._convert(self.by_name[name], words) for name, words in raw.items()}
        if positionals:
            if self.positional is None:
                self.error(f"argument {positionals[0]!r} is neither key=value nor --key value")
            values[self.positional.name] = self._convert(self.positional, positionals, split=False)
        try:
            cfg = self._build(self.cls, self.default, values, "")
        except ValueError as err:  # a config's own __post_init__ refusing a value
            self.error(str(err))
        return cfg, rest

    def _find(self, key: str) -> Option | None:
        name = _norm(key)
        return self.by_name.get(self.aliases.get(name, name))

    def _starts_option(self, word: str, known_only: bool) -> bool:
        """Whether ``word`` begins the next option, rather than being one more value of the current one."""
        if word.startswith("-") and len(word) > 1 and not _is_number(word):
            return True
        key, eq, _ = word.partition("=")
        return bool(eq) and (self._find(key) is not None or (known_only and key.replace(".", "").isidentifier()))

    def _read(self, argv: list[str], known_only: bool) -> tuple[dict[str, list[str]], list[str], list[str]]:
        """({option name: its words, the last given winning}, bare words, options for ``rest``)."""
        ahead = argv[:argv.index("--")] if "--" in argv else argv
        if "-h" in ahead or "--help" in ahead:
            sys.stdout.write(self.format_help())
            raise SystemExit(0)
        values: dict[str, list[str]] = {}
        positionals: list[str] = []
        rest: list[str] = []
        i = 0
        while i < len(argv):
            word = argv[i]
            i += 1
            if word == "--":  # everything after it is a bare word
                positionals += argv[i:]
                break
            if word.startswith("-") and len(word) > 1 and not _is_number(word):  # --key[=value]
                key, eq, value = word.lstrip("-").partition("=")
                opt = self._find(key)
                end = i
                while not eq and end < len(argv) and not self._starts_option(argv[end], known_only):
                    end += 1
                if opt is None:
                    if not known_only:
                        self._unknown(key)
                    rest += argv[i - 1:end]
                    i = end
                    continue
                if eq:
                    words = [value]
                elif opt.kind is bool and not opt.many:  # --flag alone: true; --flag false
                    words = ["true"]
                    if i < len(argv) and argv[i].lower() in TRUE + FALSE:
                        words, i = [argv[i]], i + 1
                elif opt.many:
                    if end == i:
                        self.error(f"{word} needs a value: e.g. {self._example(opt)} ({opt.name}= for an empty list)")
                    words, i = argv[i:end], end
                else:
                    if end == i:
                        self.error(f"{word} needs a value ({opt.shape()})")
                    words, i = [argv[i]], i + 1
            else:
                key, eq, value = word.partition("=")
                if eq and not key:
                    self.error(f"argument {word!r} has an empty key; write key=value")
                opt = self._find(key) if eq else None
                # a bare word: a positional, also when it is an existing file whose name holds a "="
                if not eq or (opt is None and self.positional is not None and Path(word).exists()):
                    if self.positional is None:
                        self.error(f"argument {word!r} is neither key=value nor --key value")
                    positionals.append(word)
                    continue
                if opt is None:
                    if not known_only:
                        self._unknown(key)
                    rest.append(word)
                    continue
                words = [value]
            values.pop(opt.name, None)  # the last one given wins
            values[opt.name] = words
        return values, positionals, rest

    def _unknown(self, key: str) -> NoReturn:
        names = [o.name for o in self.options if not o.hidden] + list(self.aliases)
        score = {n: difflib.SequenceMatcher(None, _norm(key), n).ratio() for n in names}
        best = max(score.values(), default=0.0)
        close = sorted((n for n in names if score[n] >= max(0.6, best - 0.1)), key=score.get, reverse=True)
        if not close:  # a leaf name without its group (targets for eval.targets), or a group's option
            close = [n for n in names if n.rpartition(".")[2] == _norm(key).rpartition(".")[2]]
        close = list(dict.fromkeys(self.aliases.get(n, n) for n in close))[:3]  # an alias suggests its option
        hint = f"; did you mean {' or '.join(self._display(n) for n in close)}?" if close else ""
        self.error(f"unknown option {key!r}{hint} ({self.prog} --help lists every option)")

    # -- values --------------------------------------------------------------------------------------------
    def _convert(self, opt: Option, words: list[str], split: bool = True) -> Any:
        if not opt.many:
            text = words[0]
            if opt.optional and text.lower() in NONE:
                return None
            try:
                return _scalar(opt.kind, text)
            except ValueError as err:
                self.error(f"{opt.name}: {text!r} {err}")
        if opt.optional and len(words) == 1 and words[0].lower() in NONE:
            return None
        items = _split(words, opt.spaced) if split else list(words)
        out = []
        for k, item in enumerate(items, 1):
            try:
                out.append(_scalar(opt.kind, item))
            except ValueError as err:
                self.error(f"{opt.name}: element {k} of {len(items)}, {item!r}, {err}; lists are written "
                           f"{self._example(opt)}")
        return opt.many(out)

    def _build(self, cls: type, base: Any, values: dict[str, Any], prefix: str) -> Any:
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            name = prefix + f.name
            current = getattr(base, f.name) if base is not None else _default(f)
            if dataclasses.is_dataclass(hints[f.name]):
                kwargs[f.name] = self._build(hints[f.name], None if current is MISSING else current, values,
                                             name + ".")
            elif name in values:
                kwargs[f.name] = values[name]
            elif current is MISSING:
                opt = self.by_name[name]
                how = f"give {opt.metavar or name.upper()}" if opt.positional else f"give {name}={opt.shape()}"
                self.error(f"{name} is required: {how}" + (f" ({opt.doc})" if opt.doc else ""))
            else:
                kwargs[f.name] = current
        return cls(**kwargs)

    # -- help ----------------------------------------------------------------------------------------------
    def _display(self, name: str) -> str:
        if not self.flags:
            return name
        return f"-{name}" if len(name) == 1 else f"--{name.replace('_', '-')}"

    def _spelling(self, o: Option) -> str:
        if o.positional:
            return o.metavar or o.name.upper()
        if self.flags:
            return f"{self._display(o.name)} {o.shape()}" if o.kind is not bool or o.many else \
                f"{self._display(o.name)} [BOOL]"
        return f"{o.name}={o.shape()}"

    def _describe(self, o: Option) -> str:
        parts = [o.doc] if o.doc else []
        also = [a for a, target in self.aliases.items() if target == o.name]
        if also:
            parts.append(f"(also {', '.join(also)})")
        default = " ".join(o.default) if o.spaced and isinstance(o.default, (tuple, list)) else _show(o.default)
        parts.append("(required)" if o.default is MISSING else f"(default: {default or 'empty'})")
        return " ".join(parts)

    def _example(self, o: Option) -> str:
        sample = [_show(v) for v in (o.default or ())][:2] if isinstance(o.default, (tuple, list)) else []
        if len(sample) < 2:
            sample = {int: ["1", "2"], float: ["3600", "1800"], bool: ["true", "false"]}.get(o.kind, ["a", "b"])
        flag = self._display(o.name) if self.flags else f"--{o.name}"
        if o.spaced:
            return f"{flag} {' '.join(sample)} or {o.name}=\"{' '.join(sample)}\""
        return f"{o.name}={','.join(sample)}, {o.name}=[{','.join(sample)}] or {flag} {' '.join(sample)}"

    def _grammar(self) -> str:
        lists = [o for o in self.options if o.many and not o.hidden and not o.positional]
        example = (f"lists as {self._example(lists[0])}" if lists else
                   "lists as a,b, [a,b] or --key a b")
        spellings = "--key value, --key=value or key=value" if self.flags else "key=value, --key value or --key=value"
        return (f"Options are written {spellings} (- and _ alike in names); {example}; booleans true/false or "
                "yes/no (--flag alone: true); none for an optional value.")

    def _entry(self, left: str, right: str, width: int) -> list[str]:
        col = 32
        lines = textwrap.wrap(right, width - col) or [""]
        if len(left) + 4 > col:
            return [f"  {left}"] + [" " * col + line for line in lines]
        return [f"  {left:<{col - 2}}{lines[0]}"] + [" " * col + line for line in lines[1:]]


def _split(words: list[str], spaced: bool) -> list[str]:
    """The elements of a list option written as one or more words: ``a,b``, ``[a, b]``, ``a b``."""
    text = " ".join(w.strip() for w in words).strip()
    if text[:1] in "[(" and text[-1:] in "])":
        text = text[1:-1]
    items = text.split() if spaced else text.replace(",", " ").split()
    return [i[1:-1] if len(i) >= 2 and i[0] == i[-1] and i[0] in "'\"" else i for i in items]


def _scalar(kind: type, text: str) -> Any:
    """``text`` as a value of ``kind``; a ValueError saying what it is not."""
    if kind is bool:
        low = text.strip().lower()
        if low in TRUE:
            return True
        if low in FALSE:
            return False
        raise ValueError("is not true or false (nor yes/no, on/off, 1/0)")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError("is not an integer") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("is not a number") from None
    return kind(text)


def parse(cls: type[T], argv: Sequence[str] | None = None, default: T | None = None,
          description: str | None = None, prog: str | None = None, **options: Any) -> T:
    """``Parser(cls, default, prog, description, **options).parse(argv)``: the usual one-liner."""
    return Parser(cls, default, prog, description, **options).parse(argv)


# -- helpers for entry points that look at a value before parsing ----------------------------------------
def find_value(argv: Sequence[str], key: str) -> str | None:
    """Value given for ``key`` as ``key=v``, ``--key v`` or ``--key=v`` (last one wins): what an entry
    point reads before building its parser (the preset named by ``env``, a ``resume=`` checkpoint)."""
    val = None
    names = {key, key.replace("_", "-")}
    for i, a in enumerate(argv):
        body = a.lstrip("-")
        k, eq, v = body.partition("=")
        if k in names:
            if eq:
                val = v
            elif a.startswith("--") and i + 1 < len(argv):
                val = argv[i + 1]
    return val


def expand_shorthands(argv: Sequence[str], shorthands: dict[str, str]) -> list[str]:
    """Rewrite shorthand option names to the options they stand for, in every spelling (``key=v``,
    ``--key v``, ``--key=v``): ``{"model": "model.name"}`` makes ``model=dt`` mean ``model.name=dt``.
    An entry point declares its shorthands next to its config; the grammar is this one."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        body, eq, val = a.lstrip("-").partition("=")
        if body in shorthands:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{a} needs a value, e.g. {body}=NAME")
                val, i = argv[i + 1], i + 1
            out.append(f"{shorthands[body]}={val}")
        else:
            out.append(a)
        i += 1
    return out
