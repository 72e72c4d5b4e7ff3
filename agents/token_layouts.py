"""The Decision Transformer's token layouts, declared once, and the one parse of ``model=``.

A *token kind* (``TOKENS``) says everything every reader needs of one token: the symbol the export's
semantics writes, the embedding module (its name is the checkpoint's parameter name), the ``Batch`` field
training reads, its width, and the stream step's value for it (``source``, one of ``STEP_VALUES``). A
*token layout* (``TOKEN_LAYOUTS``) is the kinds one environment step contributes, in order, and the kind
whose top-layer output predicts the action. The model, the sampler's batches, ``DTStep`` and
``RecomputeStep``, the export's symbols and semantics, the checkpoint's and the config's size checks read
these and nothing else, so a new layout is one entry here (a new kind: one more in ``TOKENS``).

A model name (``model=``) is parsed here once into a token layout and a stack layout
(``primal_dt.layouts``, which knows no DT names): a token layout's own name (``dt``, ``bc``) is that layout
on an all-softmax stack (the Decision Transformer paper's transformer), ``primal+<layout>`` the same with the
last layer primal, ``<stack>-<layout>`` (``primalformer-dt``) that stack; any other name is a stack layout
(``primal+<mechanism>``, a mechanism) under the Decision Transformer's tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

STEP_VALUES = {"rtg": 0, "state": 0, "prev_action": -1, "reward": -1}
"""What one stream step (``DTStep``) knows, and the step each value belongs to: this step's return-to-go
R_t / reward_scale and normalised observation s_t, the previous step's action a_{t-1} (kept in the step's
state) and reward r_{t-1} (the step's ``reward`` input). A token whose value belongs to the previous step
comes after the predicting token: its value is known only once the action is taken."""


@dataclass(frozen=True)
class TokenKind:
    symbol: str
    """how the export's semantics writes it (``R_t``, ``s_t``, ``a_{t-1}``)"""
    embedding: str
    """the model's embedding module for it (its name is the checkpoint's parameter name)"""
    field: str
    """the ``Batch`` field holding its values [B, K, width] (and ``RecomputeStep``'s ``history.<field>``)"""
    width: str | int
    """values per token: a number, or the ``DTConfig`` field giving it (``state_dim``, ``act_dim``)"""
    source: str
    """the stream step's value for it (``STEP_VALUES``)"""

    def size(self, cfg) -> int:
        return getattr(cfg, self.width) if isinstance(self.width, str) else self.width

    @property
    def lag(self) -> int:
        """-1 when the stream knows the value only at the next step (after the action), else 0."""
        return STEP_VALUES[self.source]


TOKENS = {
    "rtg": TokenKind("R", "embed_return", "rtg", 1, "rtg"),  # return-to-go / reward_scale
    "state": TokenKind("s", "embed_state", "states", "state_dim", "state"),  # normalised observation
    "action": TokenKind("a", "embed_action", "actions", "act_dim", "prev_action"),
    "reward": TokenKind("r", "embed_reward", "rewards", 1, "reward"),  # the step's raw reward
}
"""token kind -> what every reader needs of it (``TokenKind``)"""


@dataclass(frozen=True)
class TokenLayout:
    """The tokens one environment step contributes, in order, and the token whose top-layer output
    predicts the step's action (before the action token, which it may not see)."""

    kinds: tuple[str, ...]
    """token kinds per step, in sequence order (``TOKENS``)"""
    predict_from: str = "state"

    def __post_init__(self):
        unknown = [k for k in self.kinds if k not in TOKENS]
        if unknown or len(set(self.kinds)) != len(self.kinds) or self.predict_from not in self.kinds:
            raise ValueError(f"token layout {self.kinds} (predicting from {self.predict_from!r}): each kind once, "
                             f"of {', '.join(TOKENS)}, the predicting one among them")
        p = self.predictor
        late = [k for k in self.kinds[:p + 1] if TOKENS[k].lag]
        early = [k for k in self.kinds[p + 1:] if not TOKENS[k].lag]
        if late or early or "action" not in self.kinds[p + 1:]:
            raise ValueError(f"token layout {self.kinds}: the tokens up to the predicting {self.predict_from!r} "
                             f"must be known before acting (not {late}), those after it only after (not {early}), "
                             "the action among them")

    @property
    def per_step(self) -> int:
        return len(self.kinds)

    @property
    def predictor(self) -> int:
        """offset of the predicting token within its step"""
        return self.kinds.index(self.predict_from)

    @property
    def chunk(self) -> tuple[tuple[str, int], ...]:
        """What one stream step feeds the stack, as (kind, timestep offset): the tokens after the previous
        step's predicting token (its action, known only now: offset -1), then this step's up to its own."""
        p = self.predictor
        return (*((k, -1) for k in self.kinds[p + 1:]), *((k, 0) for k in self.kinds[:p + 1]))

    def token_mask(self, mask):
        """Segment mask [B, K] -> token mask [B, per_step * K]: each step's tokens share its flag."""
        return None if mask is None else mask.repeat_interleave(self.per_step, dim=1)

    def first_exact_step(self, reach: int) -> int:
        """Smallest segment step whose predicting token has ``reach`` earlier tokens inside the segment."""
        return max(0, math.ceil((reach - self.predictor) / self.per_step))


TOKEN_LAYOUTS = {
    "dt": TokenLayout(("rtg", "state", "action")),  # the Decision Transformer: conditioned on the return-to-go
    "bc": TokenLayout(("state", "action")),  # behaviour cloning (Chen et al. 2021's transformer baseline)
    "rdt": TokenLayout(("rtg", "state", "action", "reward")),  # the DT that also sees each step's reward
}
"""Token layouts by model name (module docstring: how a model name chooses one)."""
DEFAULT = "dt"
"""the token layout of a model name that names none (``linear``, ``primal+performer``)"""
BACKBONE = "softmax"
"""the stack a token layout's own name stands for (``dt``: the papers' softmax transformer)"""


class ModelName(NamedTuple):
    """What a model name means: its token layout (a ``TOKEN_LAYOUTS`` name) and its stack layout (what
    ``primal_dt.layouts.layout`` reads)."""

    tokens: str
    stack: str


def parse_name(name: str) -> ModelName:
    """The one parse of a model name (module docstring); the stack layout is checked where it is built."""
    base = name.removeprefix("primal+")
    primal_last = "primal+" * (base != name)
    if base in TOKEN_LAYOUTS:
        return ModelName(base, primal_last + BACKBONE)
    stack, dash, tokens = base.rpartition("-")
    if dash and stack and tokens in TOKEN_LAYOUTS:
        return ModelName(tokens, primal_last + stack)
    return ModelName(DEFAULT, name)


def names() -> list[str]:
    """The model names the token layouts add to the stack layouts' (for help and suggestions)."""
    return [*TOKEN_LAYOUTS, *(f"primal+{n}" for n in TOKEN_LAYOUTS), *(f"primalformer-{n}" for n in TOKEN_LAYOUTS)]
