"""Attention mechanisms on one contract (base.Attention), built by name from the registry. Importing
the package imports every mechanism's file, so that its @register runs: one line per file."""

from . import cosformer, flowformer, kerformer, kernel, linear, linformer, nystrom, performer  # noqa: F401
from . import primal, reformer, softmax, svr  # noqa: F401
from .base import Attention, Recurrent, StateSpec
from .registry import available, build_attention, get_class, register

__all__ = ["Attention", "Recurrent", "StateSpec", "available", "build_attention", "get_class", "register"]
