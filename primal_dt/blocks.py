"""Transformer blocks and stacks whose layers each name their attention mechanism.

A stack is a list of ``LayerSpec``s, so "PrimalFormer" and "Primal.+X" are configurations (layouts.py), not
code. It runs in parallel (``forward``) or recurrently (``recurrent`` -> ``StackRecurrent``, the layers' states
as one tuple); blocks are otherwise token-wise, so the two agree wherever every mechanism's do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from torch import nn

from .attention import available, build_attention, get_class
from .attention.base import Recurrent


@dataclass
class LayerSpec:
    attention: str = "softmax"
    options: dict = field(default_factory=dict)


_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, spec: LayerSpec, causal: bool, mlp_ratio: float = 4,
                 dropout: float = 0.1, norm: str = "pre", activation: str = "gelu", d_ff: int | None = None):
        super().__init__()
        if norm not in ("pre", "post"):
            raise ValueError(f"norm must be 'pre' or 'post', got {norm!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.norm = norm
        self.attn = build_attention(spec.attention, d_model, n_heads, causal=causal, **spec.options)
        hidden = d_ff or int(mlp_ratio * d_model)
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), _ACTIVATIONS[activation](),
                                 nn.Linear(hidden, d_model), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask=None, rows=None):
        """x [B, T, D] -> (y, aux). ``rows`` (a slice or index of positions): y only at those positions, [B, n, D].
        The attention still reads every position; what follows it is token-wise, so it runs only where the caller
        reads it (``Stack.forward``'s top block)."""
        a, aux = self.attn(self.ln1(x) if self.norm == "pre" else x, mask)
        if rows is not None:
            x, a = x[:, rows], a[:, rows]
        if self.norm == "pre":
            return self._residuals(x, a), aux
        x = self.ln1(x + self.drop(a))
        return self.ln2(x + self.mlp(x)), aux

    def recurrent_step(self, x, form, state, mask, last_only: bool):
        """``forward`` (pre-norm) with the attention's recurrent ``form`` in place of its parallel one: (y, state,
        aux). With ``last_only`` only the chunk's last token goes through the residuals and the MLP. In training
        mode dropout applies as in ``forward``: a chunk carrying its episode's state trains through this."""
        a, state, aux = form.forward_aux(self.ln1(x), state, mask, last_only)
        return self._residuals(x[:, -1:] if last_only else x, a), state, aux

    def _residuals(self, x, a):
        """The pre-norm block after its attention's output ``a``: the residual, then the MLP's."""
        x = x + self.drop(a)
        return x + self.mlp(self.ln2(x))


class Stack(nn.Module):
    def __init__(self, d_model: int, n_heads: int, layers: Sequence[LayerSpec | str], causal: bool = False,
                 mlp_ratio: float = 4, dropout: float = 0.1, norm: str = "pre", activation: str = "gelu",
                 d_ff: int | None = None):
        super().__init__()
        if not layers:
            raise ValueError("a stack needs at least one layer")
        self.specs = [LayerSpec(s) if isinstance(s, str) else s for s in layers]
        self.causal = causal
        self.blocks = nn.ModuleList(Block(d_model, n_heads, s, causal, mlp_ratio, dropout, norm, activation, d_ff)
                                    for s in self.specs)
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, x, mask=None, rows=None):
        """x [B, T, D] -> (y [B, T, D], list of per-layer aux dicts). ``rows`` (a slice or index of positions): y
        only there, [B, n, D], the same values. Every lower block's output feeds the next attention at every
        position, but the top block's is read only where the caller reads it, so its residual and MLP (the largest
        token-wise cost of a block) and the final norm run only there: a Decision Transformer reads one token in
        three."""
        auxes, top = [], len(self.blocks) - 1
        for i, b in enumerate(self.blocks):
            x, aux = b(x, mask, rows if i == top else None)
            auxes.append(aux)
        return self.ln_f(x), auxes

    def recurrent(self, *, window: int | None = None, chunk: int = 1) -> StackRecurrent:
        """The layers' ``Attention.recurrent`` forms as one; a ValueError names every layer that has none."""
        bad, forms = [], []
        for i, (spec, b) in enumerate(zip(self.specs, self.blocks)):
            try:
                if b.norm != "pre":
                    raise ValueError("a post-norm block (the recurrent step is pre-norm, as the Decision Transformer's)")
                forms.append(b.attn.recurrent(window=window, chunk=chunk))
            except ValueError as err:
                bad.append(f"layer {i} ({spec.attention}): {err}")
        if bad:
            ok = [n for n in available() if get_class(n).supports_step and get_class(n).supports_causal]
            raise ValueError("streaming needs every layer to have a causal recurrent form in a pre-norm block; "
                             + "; ".join(bad) + ". Use engine='recompute', or train a model whose layers stream "
                             f"({', '.join(ok)})")
        return StackRecurrent(self, forms)


class StackRecurrent(Recurrent):
    """A stack's recurrent form, final norm applied (``last_only``: lower blocks still pass every token on). Its
    state: every layer's, named ``layer<i>.<name>``, an entry ``shared`` with an earlier layer's held once, by it."""

    def __init__(self, stack: Stack, forms):
        holder, names = {}, []  # holder: a shared entry's key -> the first layer declaring it, which holds it
        specs = {}  # the stack's entries by name, in order
        for i, f in enumerate(forms):
            names.append({s.name: f"layer{holder.setdefault((s.shared, s.name), i) if s.shared else i}.{s.name}"
                          for s in f.specs})
            for s in f.specs:
                specs.setdefault(names[i][s.name], dataclasses.replace(s, name=names[i][s.name],
                                                                       masked_by=names[i].get(s.masked_by, "")))
        super().__init__(specs.values())
        self.slots = [[list(specs).index(names[i][s.name]) for s in f.specs] for i, f in enumerate(forms)]
        self.stack = stack
        self.forms = nn.ModuleList(forms)

    def forward(self, x, state, mask=None, last_only: bool = False):
        y, state, _ = self.forward_aux(x, state, mask, last_only)
        return y, state

    def forward_aux(self, x, state, mask=None, last_only: bool = False):
        """``forward`` and every layer's aux dict (``Stack.forward``'s list, for the regulariser)."""
        new, auxes, top = {}, [], len(self.forms) - 1
        for i, (block, form, slots) in enumerate(zip(self.stack.blocks, self.forms, self.slots)):
            x, st, aux = block.recurrent_step(x, form, tuple(state[j] for j in slots), mask, last_only and i == top)
            auxes.append(aux)
            for j, s in zip(slots, st):
                new.setdefault(j, s)  # a shared entry: its holder's (every layer sharing it computes the same)
        return self.stack.ln_f(x), tuple(new[j] for j in range(len(state))), auxes
