"""Policies built on the attention core: the Decision Transformer and the agents that act with it."""

from .agent import Agent, load_agent
from .decision_transformer import DecisionTransformer, DTConfig
from .dt_checkpoint import DataInfo, DTCheckpoint

__all__ = ["Agent", "DTCheckpoint", "DataInfo", "DecisionTransformer", "DTConfig", "load_agent"]
