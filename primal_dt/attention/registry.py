"""Build attention mechanisms by name, so that model layouts are data (strings in a config)."""

from __future__ import annotations

import difflib
import inspect
import typing

from .base import Attention

_REGISTRY: dict[str, type[Attention]] = {}


def register(name: str):
    """Class decorator: make a mechanism buildable as ``build_attention(name, ...)``."""

    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention name {name!r} registered twice")
        _REGISTRY[name] = cls
        return cls

    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def get_class(name: str) -> type[Attention]:
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), _REGISTRY, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown attention mechanism {name!r}.{hint} Available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


SHARED = ("self", "d_model", "n_heads", "causal")
"""constructor arguments every mechanism takes; the rest are its own options"""


def constructor_options(name: str) -> dict[str, object]:
    """{option: its type annotation (None if unannotated)} that mechanism ``name`` accepts beyond ``SHARED``:
    what a config may set for it, read from its constructor so no list of options is kept by hand."""
    init = get_class(name).__init__
    hints = typing.get_type_hints(init)
    return {n: hints.get(n) for n in inspect.signature(init).parameters if n not in SHARED}


def build_attention(name: str, d_model: int, n_heads: int, causal: bool = False, **options) -> Attention:
    """Instantiate mechanism ``name``; unknown options are reported with the accepted ones."""
    ok = list(constructor_options(name))
    bad = [k for k in options if k not in ok]
    if bad:
        raise ValueError(f"attention {name!r} does not accept option(s) {bad}; accepted: {ok}")
    return get_class(name)(d_model, n_heads, causal=causal, **options)

