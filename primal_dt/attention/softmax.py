"""Canonical multi-head softmax attention (Vaswani et al. 2017) on PyTorch's fused SDPA kernel.

softmax(q k^T / sqrt(d)) v per head, with padding, causal and sliding-window masks. The recurrent
form is a key/value cache, bounded to the last ``window - 1`` positions when a window is set.

Window semantics (shared with every windowed mechanism): position t sees positions
t - window < j <= t; padding inside the window is invisible but still occupies its slot.
A padding query attends to itself only (so no row is empty) and its output is zeroed.

``impl="sdpa"`` (default) uses the fused kernel (flash-style on CPU: O(T) memory);
``impl="materialized"`` forms the T x T score matrix explicitly, the canonical attention the
papers compared against (same parameters, same outputs, O(T^2) memory).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Attention, check_window, zero_padding
from .registry import register


def visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """[Tq, Tk] bool: may the query at absolute position q_pos[i] see the key at k_pos[j]?"""
    d = q_pos[:, None] - k_pos[None, :]
    ok = torch.ones_like(d, dtype=torch.bool)
    if causal:
        ok &= d >= 0
    if window is not None:
        ok &= d < window
        if not causal:
            ok &= d > -window
    return ok


@register("softmax")
class SoftmaxAttention(Attention):
    supports_step = True
    supports_window = True

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, window: int | None = None,
                 dropout: float = 0.0, bias: bool = True, impl: str = "sdpa"):
        super().__init__(d_model, n_heads, causal)
        if impl not in ("sdpa", "materialized"):
            raise ValueError(f"impl must be 'sdpa' or 'materialized', got {impl!r}")
        self.impl = impl
        self.window = check_window(window)
        self.dropout = float(dropout)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def _attend(self, q, k, v, allowed: torch.Tensor | None, is_causal: bool = False):
        p = self.dropout if self.training else 0.0
        if self.impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p, is_causal=is_causal)
            return self.proj(self.merge_heads(y))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_head)
        if is_causal:
            T = q.shape[2]
            allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        w = F.dropout(torch.softmax(scores, dim=-1), p, self.training)
        return self.proj(self.merge_heads(w @ v))

    def forward(self, x, mask=None):
        self.check_input(x, mask)
        B, T, _ = x.shape
        q, k, v = map(self.split_heads, self.qkv(x).split(self.d_model, dim=-1))
        if mask is None and self.window is None:
            return self._attend(q, k, v, None, is_causal=self.causal), {}
        pos = torch.arange(T, device=x.device)
        allowed = visibility(pos, pos, self.causal, self.window)[None, None]  # [1, 1, T, T]
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]
            allowed = allowed | torch.eye(T, dtype=torch.bool, device=x.device)  # padding rows
        return zero_padding(self._attend(q, k, v, allowed), mask), {}

    @torch.no_grad()
    def attention_matrix(self, x, mask=None) -> torch.Tensor:
        """[B, H, T, T]: the attention weights softmax(q k^T / sqrt(d)) with forward's masks
        (rows of padding queries are zero). For inspection (eval.spectrum), not for training."""
        self.check_input(x, mask)
        T = x.shape[1]
        q, k, _ = map(self.split_heads, self.qkv(x).split(self.d_model, dim=-1))
        pos = torch.arange(T, device=x.device)
        allowed = visibility(pos, pos, self.causal, self.window)[None, None]
        if mask is not None:
            allowed = (allowed & mask[:, None, None, :]) | torch.eye(T, dtype=torch.bool, device=x.device)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(self.d_head)).masked_fill(~allowed, float("-inf"))
        w = torch.softmax(scores, dim=-1)
        return w if mask is None else w * mask[:, None, :, None].to(w.dtype)

    # -- recurrent form: key/value cache --------------------------------------------------------
    def init_state(self, batch, device=None, dtype=None):
        self._require_step()
        dtype = dtype or self.qkv.weight.dtype
        shape = (batch, self.n_heads, 0, self.d_head)
        return {"k": torch.zeros(shape, device=device, dtype=dtype),
                "v": torch.zeros(shape, device=device, dtype=dtype),
                "m": torch.zeros(batch, 0, dtype=torch.bool, device=device), "pos": 0}

    def step(self, x, state, mask=None):
        self._require_step()
        self.check_input(x, mask)
        B, C, _ = x.shape
        q, k, v = map(self.split_heads, self.qkv(x).split(self.d_model, dim=-1))
        m = torch.ones(B, C, dtype=torch.bool, device=x.device) if mask is None else mask
        K = torch.cat([state["k"], k], dim=2)
        V = torch.cat([state["v"], v], dim=2)
        M = torch.cat([state["m"], m], dim=1)
        p0, Tk = state["pos"], K.shape[2]
        q_pos = torch.arange(p0, p0 + C, device=x.device)
        k_pos = torch.arange(p0 + C - Tk, p0 + C, device=x.device)
        allowed = visibility(q_pos, k_pos, True, self.window)[None, None] & M[:, None, None, :]
        allowed = allowed | (q_pos[:, None] == k_pos[None, :])[None, None]
        y = zero_padding(self._attend(q, K, V, allowed), mask)
        if self.window is not None:
            start = max(0, Tk - (self.window - 1))
            K, V, M = K[:, :, start:], V[:, :, start:], M[:, start:]
        return y, {"k": K, "v": V, "m": M, "pos": p0 + C}
