"""Command lines shared by every entry point: tyro dataclass configs that also take ``key=value``.

``python -m primal_dt.train env=hopper-medium model=primal+dt model.s=64 --steps 2000`` is parsed
by turning each ``key=value`` into tyro's ``--key value``; booleans take explicit values
(``eval.enabled=false``) so that both spellings behave alike. ``--help`` is tyro's, listing
every option with its default.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TypeVar

import tyro

T = TypeVar("T")
_BOOLS = {"true": "True", "false": "False", "yes": "True", "no": "False", "on": "True", "off": "False"}


def _number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def to_tyro_args(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    values_ok = False  # after --key, bare tokens are its value(s) (several for tuple options)
    for a in argv:
        if values_ok and _number(a):  # a negative value of the preceding --key (eval.targets=-100,50), not a flag
            out.append(a)
        elif a.startswith("-"):
            out.append(a)
            values_ok = a.startswith("--") and "=" not in a
        elif "=" in a:
            k, v = a.split("=", 1)
            if not k:
                raise SystemExit(f"error: argument {a!r} has an empty key; write key=value")
            out += [f"--{k}", _BOOLS.get(v.lower(), v)]
            values_ok = False
        elif values_ok:
            out.append(a)  # a value of the preceding --key
        else:
            raise SystemExit(f"error: argument {a!r} is neither key=value nor --key value")
    return out


def find_value(argv: Sequence[str], key: str) -> str | None:
    """Value given for ``key`` as ``key=v``, ``--key v`` or ``--key=v`` (last one wins)."""
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


def split_lists(argv: Sequence[str], keys: Sequence[str]) -> list[str]:
    """``key=a,b`` for the tuple options ``keys`` becomes tyro's ``--key a b``."""
    out: list[str] = []
    for a in argv:
        k, eq, val = a.partition("=")
        if eq and k in keys and not a.startswith("-"):
            out += [f"--{k}", *[v for v in val.split(",") if v.strip()]]
        else:
            out.append(a)
    return out


def parse(cls: type[T], argv: Sequence[str] | None = None, default: T | None = None,
          description: str | None = None, prog: str | None = None) -> T:
    argv = sys.argv[1:] if argv is None else list(argv)
    return tyro.cli(cls, args=to_tyro_args(argv), default=default, description=description, prog=prog,
                    config=(tyro.conf.FlagConversionOff,))
