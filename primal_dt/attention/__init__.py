"""Attention mechanisms on one contract (base.Attention), built by name from the registry."""

from . import _mechanisms  # noqa: F401  (registers every mechanism)
from .base import Attention
from .registry import available, build_attention, get_class, register
from .state import State

__all__ = ["Attention", "State", "available", "build_attention", "get_class", "register"]
