"""Sequence classifier on the same attention stack as the Decision Transformer.

input (channels -> Linear, or token ids -> Embedding) + learnable positions -> Stack (non-causal, masked) ->
- ``flatten`` (UEA, as the papers): the masked features [T * D] -> Linear. Padding features are zero, so a
  batch padded beyond ``max_len`` (with padding only) is cut back and a shorter one zero-filled: a prediction
  never depends on how its series was padded.
- ``mean`` (LRA): mean over real tokens -> MLP.
- ``pair`` (LRA Retrieval): both documents through the shared encoder, mean pooled to u, v, then
  MLP([u, v, u * v, u - v]) as the LRA dual-encoder baseline.
Loss = cross-entropy + the KSVD regulariser of the primal layers (primal_dt/ksvd.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import LayerSpec, Stack
from .ksvd import ksvd_objective, ksvd_regularizer


@dataclass
class Output:
    logits: torch.Tensor
    auxes: list


class SequenceClassifier(nn.Module):
    def __init__(self, layers: list[LayerSpec], *, input_kind: str, n_inputs: int, n_classes: int, max_len: int,
                 head: str, d_model: int = 64, n_heads: int = 2, d_ff: int | None = None, dropout: float = 0.1,
                 norm: str = "pre", activation: str = "gelu"):
        super().__init__()
        self.input_kind, self.head_kind, self.max_len = input_kind, head, max_len
        self.embed = (nn.Linear(n_inputs, d_model) if input_kind == "continuous"
                      else nn.Embedding(n_inputs, d_model, padding_idx=0))
        self.pos = nn.Parameter(torch.empty(max_len, d_model))
        nn.init.uniform_(self.pos, -0.02, 0.02)
        self.drop = nn.Dropout(dropout)
        self.stack = Stack(d_model, n_heads, layers, causal=False, dropout=dropout, norm=norm,
                           activation=activation, d_ff=d_ff)
        hidden = d_ff or 2 * d_model
        if head == "flatten":
            self.head = nn.Sequential(nn.GELU(), nn.Dropout(dropout), nn.Flatten(),
                                      nn.Linear(max_len * d_model, n_classes))
        else:
            width = 4 * d_model if head == "pair" else d_model
            self.head = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))

    def encode(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list]:
        """[B, T(, C)] -> features [B, T, D] (zero at padding) and per-layer aux dicts."""
        T = x.shape[1]
        if T > self.max_len:
            if mask[:, self.max_len:].any():
                raise ValueError(f"sequences have real tokens beyond the model's max_len={self.max_len}")
            x, mask, T = x[:, : self.max_len], mask[:, : self.max_len], self.max_len
        h = self.embed(x if self.input_kind == "continuous" else x.long()) + self.pos[:T]
        m = mask.unsqueeze(-1).to(h.dtype)
        h, auxes = self.stack(self.drop(h) * m, mask)
        return h * m, auxes

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> Output:
        if self.head_kind == "pair":  # [B, 2, T] -> one encoder batch of 2B documents
            B = x.shape[0]
            h, auxes = self.encode(x.flatten(0, 1), mask.flatten(0, 1))
            u, v = mean_pool(h, mask.flatten(0, 1)).view(B, 2, -1).unbind(1)
            return Output(self.head(torch.cat([u, v, u * v, u - v], dim=-1)), auxes)
        h, auxes = self.encode(x, mask)
        if self.head_kind == "mean":
            return Output(self.head(mean_pool(h, mask)), auxes)
        return Output(self.head(F.pad(h, (0, 0, 0, self.max_len - h.shape[1]))), auxes)  # zero-fill to max_len


def mean_pool(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of features over real tokens (h is already zero at padding)."""
    return h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1).to(h.dtype)


def classification_loss(out: Output, y: torch.Tensor, eta: float) -> tuple[torch.Tensor, dict]:
    """CE + eta * KSVD term; also returns the parts for logging (ce, ksvd, J per primal layer)."""
    ce = F.cross_entropy(out.logits, y)
    reg = ksvd_regularizer(out.auxes, eta)
    parts = {"ce": ce.detach(), "ksvd": torch.as_tensor(reg).detach()}
    for i, aux in enumerate(out.auxes):  # named by stack position, so logs line up across layouts
        if aux and "Lambda" in aux:
            parts[f"J/layer{i}"] = ksvd_objective(aux).detach().mean()
    return ce + reg, parts
