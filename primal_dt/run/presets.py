"""Named presets: YAML files (configs/<group>/<name>.yaml) applied over a config dataclass's defaults, so
the papers' settings are data a user reads and copies. ``META_KEYS`` are the file's own, not options.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from .errors import did_you_mean

CONFIG_ROOT = Path(__file__).resolve().parents[2] / "configs"
META_KEYS = ("source", "description", "paper")
_NAME = re.compile(r"[A-Za-z0-9_+][A-Za-z0-9_.+-]*")


def list_presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_ROOT / group).glob("*.yaml"))


def load_preset(group: str, name: str) -> dict:
    """The preset ``name`` of ``group``: a bare file name, never a path, so ``preset=../../x`` reads nothing
    outside configs/."""
    path = CONFIG_ROOT / group / f"{name}.yaml"
    if not _NAME.fullmatch(name) or not path.resolve().is_relative_to(CONFIG_ROOT.resolve() / group):
        raise ValueError(f"{group} preset {name!r} is not a preset name (letters, digits, '.', '-', '_', '+'; no "
                         f"path): presets are the files of {CONFIG_ROOT / group}; available: "
                         f"{', '.join(list_presets(group)) or '(none)'}")
    if not path.exists():
        names = list_presets(group)
        raise ValueError(f"unknown {group} preset {name!r}.{did_you_mean(name, names)} Available: "
                         f"{', '.join(names) or '(none)'}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"preset file {path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"preset file {path} must hold a mapping of option: value")
    return data


def apply_preset(cfg: Any, values: dict, where: str = "preset", top: bool = True) -> Any:
    """A copy of dataclass ``cfg`` with ``values`` (nested dicts for nested dataclasses) checked and applied."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    hints = typing.get_type_hints(type(cfg))
    changes = {}
    for key, val in values.items():
        if top and key in META_KEYS:
            continue
        if key not in fields:
            raise ValueError(f"{where}: unknown option {key!r}.{did_you_mean(key, fields, n=2)} Options: "
                             f"{', '.join(fields)}")
        cur = getattr(cfg, key)
        if dataclasses.is_dataclass(cur):
            if not isinstance(val, dict):
                raise ValueError(f"{where}: {key} must be a mapping of its options, got {repr(val)[:60]}")
            changes[key] = apply_preset(cur, val, f"{where}.{key}", top=False)
        else:
            if not fits(val, hints[key]):
                raise ValueError(f"{where}: {key} must be {kind(hints[key])}, got {repr(val)[:60]}")
            changes[key] = tuple(val) if typing.get_origin(hints[key]) is tuple else val  # YAML and JSON give lists
    return dataclasses.replace(cfg, **changes)


def fits(value: Any, hint: Any) -> bool:
    """Whether a preset's or a saved config's ``value`` is of the annotation's kind, so ``eval: 5`` is refused by
    name here, not later in code that trusts the type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (bool, int, float, str):  # a bool is no number
        kinds = (int, float) if hint is float else hint
        return isinstance(value, kinds) and (hint is bool or not isinstance(value, bool))
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return isinstance(value, (list, tuple)) and all(fits(v, args[0]) for v in value)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) if a is not type(None) else value is None for a in args)
    return True


def kind(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if typing.get_origin(hint) is tuple:
        return f"a list of {kind(typing.get_args(hint)[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def refuse_changes(asked: dict, saved: dict, given, may_change, where: str) -> None:
    """A resumed run's check: each option ``given`` on the command line (dotted) that is not in ``may_change`` (or
    under a group there) must agree with the checkpoint's ``saved`` config (``asked``: the config the line asks
    for; both flat dicts), so resuming a primal run as another model is an error, not a silent mix."""
    for key in given:
        if key not in may_change and key.split(".")[0] not in may_change and asked[key] != saved.get(key):
            raise ValueError(f"checkpoint {where} was trained with {key}={saved.get(key)!r}, but the command line "
                             f"asks for {key}={asked[key]!r}; resume without that option, or start a new run")


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
