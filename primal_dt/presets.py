"""Named presets: YAML files under the top-level ``configs/`` package (configs/<group>/<name>.yaml).

A preset is a nested mapping applied over a config dataclass's defaults, so the papers' settings
are data a user can read and copy. Each file carries a ``source`` line saying where its numbers
come from; entry points print it. A DT dataset preset may also carry ``paper`` (model -> the paper's
final normalized score), which ``eval.report`` prints beside measured scores; neither is an option.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

import yaml

CONFIG_ROOT = Path(__file__).resolve().parent.parent / "configs"
META_KEYS = ("source", "description", "paper")


def list_presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_ROOT / group).glob("*.yaml"))


def load_preset(group: str, name: str) -> dict:
    path = CONFIG_ROOT / group / f"{name}.yaml"
    if not path.exists():
        names = list_presets(group)
        close = difflib.get_close_matches(name, names, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown {group} preset {name!r}.{hint} Available: {', '.join(names) or '(none)'}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"preset file {path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"preset file {path} must hold a mapping of option: value")
    return data


def apply_preset(cfg: Any, values: dict, where: str = "preset", top: bool = True) -> Any:
    """A copy of dataclass ``cfg`` with ``values`` (nested dicts for nested dataclasses) applied.

    ``source`` / ``description`` are the preset file's own metadata only at the top level; nested
    sections may have real options of those names.
    """
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    changes = {}
    for key, val in values.items():
        if top and key in META_KEYS:
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=2)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"{where}: unknown option {key!r}{hint}; options: {', '.join(fields)}")
        cur = getattr(cfg, key)
        if dataclasses.is_dataclass(cur) and isinstance(val, dict):
            changes[key] = apply_preset(cur, val, f"{where}.{key}", top=False)
        else:
            changes[key] = val
    return dataclasses.replace(cfg, **changes)
