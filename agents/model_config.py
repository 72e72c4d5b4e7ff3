"""The Decision Transformer's configuration, beside the model it builds: ``ModelConfig`` (the options a user
writes, ``model.*``; ``agents.train_config`` puts it on the command line) and ``DTConfig`` (those plus what
the data and the run fix: what a checkpoint keeps as ``model_config``).

Every check of these fields is here, and so is what they mean: ``ModelConfig.plan`` parses the model name
(``agents.token_layouts.parse_name``) and the attention options (``mechanism.option=value`` words) once per
distinct set of values and remembers the result, so the command line's check, the network's construction,
stream-exact training's windowing and the checkpoint reader all read one parse.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal, NamedTuple

from primal_dt.attention import available, get_class
from primal_dt.blocks import LayerSpec
from primal_dt.layouts import canonical, layout
from primal_dt.run.errors import did_you_mean
from primal_dt.run.options import AT_LEAST_1, FRACTION, POSITIVE, as_words, check_numbers
from primal_dt.run.options import attention_options as parse_attention_options

from .token_layouts import TOKEN_LAYOUTS, TokenLayout, names, parse_name


class Plan(NamedTuple):
    """What a ``ModelConfig`` means, checked: its token layout, the stack layout of its name or of each
    ``layers`` name (``primal_dt.layouts``), and the attention options."""

    tokens: TokenLayout
    stacks: tuple[str, ...]
    options: dict


@dataclass
class ModelConfig:
    """The Decision Transformer's layout and sizes (``model.*``): the network is built from exactly this
    (``DTConfig`` adds the data's dimensions), so each check of these fields is here."""

    name: str = "primal+dt"
    """layout: a token layout (dt, bc, ...: agents/token_layouts.py) on softmax layers | primal+<token layout> (the last
    layer primal: primal+dt) | primalformer-<token layout> (every layer primal) | primal+<mechanism> | any attention
    mechanism (with the dt tokens)"""
    layers: str = ""
    """explicit comma-separated mechanism per layer, e.g. softmax,linear,primal (overrides name, n_layers)"""
    d_model: int = 256
    """width of every token embedding and layer"""
    n_heads: int = 4
    """attention heads per layer (d_model must be divisible by it)"""
    n_layers: int = 3
    """transformer blocks (when model.layers does not list them)"""
    s: int = 64
    """Primal-Attention projection directions per head (primal layers only)"""
    dropout: float = 0.1
    """dropout of embeddings, attention outputs and MLPs"""
    activation: Literal["relu", "gelu"] = "relu"
    """MLP activation"""
    mlp_ratio: float = 4.0
    """MLP hidden width / d_model"""
    attention_options: tuple[str, ...] = ()
    """mechanism constructor options as mechanism.option=value, e.g. softmax.window=30,primal.window=10"""

    def __post_init__(self):
        self.attention_options = as_words(self.attention_options)

    def layer_names(self) -> tuple[str, ...]:
        """The explicit per-layer mechanisms (empty: the layout ``name`` decides)."""
        return tuple(x.strip() for x in self.layers.split(",") if x.strip())

    def plan(self) -> Plan:
        """These options checked and parsed (a ValueError naming the option otherwise); remembered by value,
        so asking again costs a lookup. Its dicts are shared: ``options`` and ``layer_specs`` hand out copies."""
        key = tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(ModelConfig))
        key = tuple((k, as_words(v) if k == "attention_options" else v) for k, v in key)
        try:
            hash(key)
        except TypeError:  # a value of the wrong kind: checked (and refused by name) without remembering it
            return _plan.__wrapped__(key)
        return _plan(key)

    def check(self) -> None:
        self.plan()

    @property
    def tokens(self) -> TokenLayout:
        """The token layout the model name chooses (``agents.token_layouts``)."""
        return self.plan().tokens

    def options(self) -> dict:
        """Per-mechanism constructor options: ``attention_options``, with ``s`` for primal layers."""
        return {m: dict(v) for m, v in self.plan().options.items()}

    def layer_specs(self) -> list[LayerSpec]:
        """Every layer (built here, from the plan: a layer count is checked before a list that long is made)."""
        plan = self.plan()
        if self.layer_names():  # one single-layer layout per name: aliases (trans -> softmax) and checks apply
            return [layout(stack, 1, plan.options)[0] for stack in plan.stacks]
        return layout(plan.stacks[0], self.n_layers, plan.options)


@functools.lru_cache(maxsize=256)
def _plan(key: tuple) -> Plan:
    m = ModelConfig(**dict(key))
    check_numbers(m, {"d_model": AT_LEAST_1, "n_heads": AT_LEAST_1, "n_layers": AT_LEAST_1, "s": AT_LEAST_1,
                      "dropout": FRACTION, "mlp_ratio": POSITIVE}, prefix="model.")
    if m.d_model % m.n_heads:
        raise ValueError(f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}")
    if int(m.mlp_ratio * m.d_model) < 1:
        raise ValueError(f"model.mlp_ratio={m.mlp_ratio} leaves no hidden units at model.d_model="
                         f"{m.d_model}; raise model.mlp_ratio")
    mechanisms = available()
    causal = [n for n in mechanisms if get_class(n).supports_causal]
    stacks = {n: parse_name(n).stack for n in m.layer_names() or (m.name,)}
    for n, stack in stacks.items():
        base = canonical(stack.removeprefix("primal+"))
        if base not in mechanisms:
            hint = did_you_mean(n, [*names(), *mechanisms])
            raise ValueError(f"unknown model {n!r}.{hint} Use {', '.join(TOKEN_LAYOUTS)}, primal+dt, primalformer-dt, "
                             f"primal+<mechanism> or a mechanism: {', '.join(mechanisms)}")
        if base not in causal:
            raise ValueError(f"model {n!r}: {base} attention has no causal form, and a Decision Transformer must "
                             f"not see future steps; use one of {', '.join(causal)}")
    options = parse_attention_options(m.attention_options, "model.attention_options", {"primal": {"s": m.s}})
    return Plan(TOKEN_LAYOUTS[parse_name(m.name).tokens], tuple(stacks[n] for n in m.layer_names() or (m.name,)),
                options)


@dataclass(kw_only=True)
class DTConfig(ModelConfig):
    """The network: the model options as the user writes them, plus what the data and the run fix."""

    state_dim: int
    act_dim: int
    K: int = 20
    """context length in environment steps (``tokens.per_step`` K tokens)"""
    max_timestep: int = 1000
    """size of the timestep embedding; timesteps are clipped to max_timestep - 1"""

    def check(self) -> None:
        """The fields this config adds; then the model options' own checks (``ModelConfig.check``)."""
        for name in ("state_dim", "act_dim", "K", "max_timestep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {name} must be an integer >= 1, got {v!r}")
        super().check()
