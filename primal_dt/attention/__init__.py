"""Attention mechanisms on one contract (base.Attention), built by name from the registry."""

from . import _mechanisms  # noqa: F401  (registers every mechanism)
from .base import Attention
from .registry import available, build_attention, get_class, register

__all__ = ["Attention", "available", "build_attention", "get_class", "register"]
