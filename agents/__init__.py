"""Policies built on the attention core: the Decision Transformer and the agents that act with it."""

from .agent import Agent, load_agent
from .decision_transformer import DecisionTransformer, DTConfig, build_from_checkpoint

__all__ = ["Agent", "DecisionTransformer", "DTConfig", "build_from_checkpoint", "load_agent"]
