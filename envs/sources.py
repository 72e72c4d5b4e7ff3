"""Where offline data comes from: a registry of sources, each one reader registered under its prefix.

``data_source=PREFIX:WHERE`` reads the data at WHERE (a path, a dataset id) with that source's reader;
``data_source=PREFIX`` lets the reader find the data of the dataset name itself; ``auto`` asks the readers
in ``AUTO`` order. A reader says "nothing here" with ``DatasetNotFound`` (the search moves on) and
"something broken here" with ``DatasetError`` (the search stops: falling back to other data would make
results incomparable). A new source is one module holding its reader under ``@register``, listed in
``_MODULES``; nothing else lists sources.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from envs.registry import EnvSpec
from primal_dt.run.errors import did_you_mean

AUTO = ("d4rl", "minari", "replica")
"""``data_source=auto``: a local then downloaded D4RL file, a local then downloaded Minari dataset, then a replica"""
_MODULES = ("envs.d4rl", "envs.minari_source", "envs.replica")


class DatasetError(ValueError):
    """A dataset exists but cannot be used; the message says what, where and what to do."""


class DatasetNotFound(FileNotFoundError):
    """No dataset at the place a source looks; the next source may still have one."""


@dataclass(frozen=True)
class Request:
    """What a reader is asked for: the data of ``spec``, at ``where`` ('': where this source keeps that name's)."""

    spec: EnvSpec
    where: str = ""
    download: bool = False  # a reader may fetch from the network (off when $PRIMAL_DT_OFFLINE=1)
    verbose: bool = True


@dataclass(frozen=True)
class Source:
    prefix: str
    read: Callable  # (Request) -> envs.Trajectories
    where: str  # what follows ``prefix:`` (PATH, ID)
    help: str
    label: str  # how a report names its data; ``{where}`` is replaced by the location


_REGISTRY: dict[str, Source] = {}


def register(prefix: str, where: str, help: str, label: str | None = None):
    """Function decorator: make ``read(Request) -> Trajectories`` the reader of ``data_source=prefix[:where]``."""
    def deco(read):
        if prefix in _REGISTRY and _REGISTRY[prefix].read is not read or prefix == "auto" or ":" in prefix:
            raise ValueError(f"data source {prefix!r} registered twice (or a reserved name)")
        _REGISTRY[prefix] = Source(prefix, read, where, help, label or prefix)
        return read

    return deco


def available() -> list[str]:
    for m in _MODULES:
        importlib.import_module(m)
    return [p for p in AUTO if p in _REGISTRY] + sorted(p for p in _REGISTRY if p not in AUTO)


def help_text() -> str:
    names = available()
    return "; ".join([f"auto: the first of {', '.join(p for p in AUTO if p in names)} that has the data (default)"]
                     + [f"{p}[:{_REGISTRY[p].where}]: {_REGISTRY[p].help}" for p in names])


def parse(source: str) -> tuple[Source | None, str]:
    """(the source, the location after its prefix) ``data_source`` names; (None, '') for auto. A ValueError
    naming the accepted forms otherwise."""
    prefix, _, where = str(source).strip().partition(":")
    if prefix == "auto" and not where:
        return None, ""
    if prefix not in available():
        raise ValueError(f"data source {source!r} is not one of auto, {', '.join(available())} (each also as "
                         f"NAME:WHERE).{did_you_mean(prefix, available(), n=1)} Accepted: {help_text()}")
    return _REGISTRY[prefix], where


def label(source: str) -> str:
    """A recorded ``data_source`` in a report's words (``D4RL``, ``Minari <id>``, ``replica``; paths left out,
    they differ between machines); 'unknown' for what names no source."""
    try:
        src, where = parse(source)
    except ValueError:
        return "unknown"
    return "unknown" if src is None else src.label.format(where=where)


def order(spec: EnvSpec) -> list[Source]:
    """The sources ``auto`` asks for ``spec``: a Minari dataset id has Minari as its only source."""
    return [_REGISTRY[p] for p in available() if p in (("minari",) if spec.is_minari_id else AUTO)]


def read(src: Source, request: Request):
    """``src``'s data for the request; finding a Minari dataset id by name is Minari's alone."""
    if not request.where and request.spec.is_minari_id and src not in order(request.spec):
        raise DatasetError(f"env={request.spec.name} names a Minari dataset; data_source={src.prefix} cannot find it "
                           f"by that name (use data_source=auto or minari, or a {src.prefix}:{src.where} of its own)")
    return src.read(request)
