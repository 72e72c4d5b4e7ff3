"""Imports every mechanism module so that its @register decorator runs. One line per file."""

from . import primal, softmax  # noqa: F401
