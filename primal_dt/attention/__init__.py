"""Attention mechanisms on one contract (base.Attention), built by name from the registry."""

from . import _mechanisms  # noqa: F401  (registers every mechanism)
from .base import Attention, Recurrent, StateSpec
from .registry import available, build_attention, get_class, register

__all__ = ["Attention", "Recurrent", "StateSpec", "available", "build_attention", "get_class", "register"]
