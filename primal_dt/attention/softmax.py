"""Canonical multi-head softmax attention (Vaswani et al. 2017) on PyTorch's fused SDPA kernel.

softmax(q k^T / sqrt(d)) v per head, with padding, causal and sliding-window masks. Window semantics (shared
with every windowed mechanism): position t sees t - window < j <= t; padding inside the window is invisible
but occupies its slot. A padding query attends to itself only (no row is empty); its output is zeroed.

``impl="sdpa"`` uses the fused kernel (flash-style on CPU: O(T) memory); ``impl="materialized"`` forms the
T x T scores, the canonical attention the papers compared against (same outputs, O(T^2) memory). ``impl="auto"``
(default) materializes bf16 and float16 scores on a CPU while a call's fit ``MATERIALIZE_MAX`` elements, and uses
SDPA elsewhere: on the Decision Transformer's short sequences (60 to 120 tokens) a bf16 training step through the
CPU flash kernel is slower than through the plain matmuls, with one thread or two, while a float32 one is as fast
with one thread and faster with two (measured: ``python -m eval.bench.train --attention_impl auto sdpa --amp off
bf16``, with ``--threads 1`` and ``0``).

Recurrent form (``SoftmaxRecurrent``): a key/value ring over the layer's window, else over the bounded window
the caller passes (an unwindowed cache would grow with the sequence).
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from .base import ProjectedAttention, Recurrent, StateSpec, check_int, check_window, static, stream_in_pieces
from .registry import register


MATERIALIZE_MAX = 2 ** 26
"""``impl="auto"`` on a CPU: the most bf16 or float16 score elements (batch x heads x queries x keys) a call
materializes (128 MiB in bf16) before it uses SDPA's O(T)-memory kernel instead"""
LOW_PRECISION = (torch.bfloat16, torch.float16)


def ring_attention(q, K, V, allowed):
    """softmax(q K^T / sqrt(d), masked by ``allowed``) V for a chunk's few queries over a ring of keys: not SDPA,
    whose CPU kernel is built for long query blocks and whose exported form guards fully masked rows. Masked
    scores are the lowest finite value, not -inf: a query that sees nothing averages the values, not NaN."""
    scores = torch.matmul(q, K.transpose(-1, -2))
    lowest = torch.finfo(scores.dtype).min
    return torch.matmul(torch.softmax(torch.where(allowed, scores.mul_(q.shape[-1] ** -0.5), lowest), -1), V)


@register("softmax")
class SoftmaxAttention(ProjectedAttention):
    supports_step = True
    supports_window = True

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, window: int | None = None,
                 dropout: float = 0.0, bias: bool = True, impl: str = "auto"):
        super().__init__(d_model, n_heads, causal, bias)
        if impl not in ("auto", "sdpa", "materialized"):
            raise ValueError(f"impl must be 'auto', 'sdpa' or 'materialized', got {impl!r}")
        self.impl = impl
        self.window = check_window(window)
        self.dropout = float(dropout)

    def _attend(self, q, k, v, allowed: torch.Tensor | None, is_causal: bool = False):
        p = self.dropout if self.training else 0.0
        if self.impl == "sdpa" or self.impl == "auto" and not (q.device.type == "cpu" and q.dtype in LOW_PRECISION
                                                             and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
                                                             <= MATERIALIZE_MAX):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p, is_causal=is_causal)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_head)
        if is_causal:
            allowed = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return F.dropout(torch.softmax(scores, dim=-1), p, self.training) @ v

    def attend(self, q, k, v, mask, state):
        if mask is None and self.window is None:
            return self._attend(q, k, v, None, is_causal=self.causal), None
        T = q.shape[2]
        d = torch.arange(T, device=q.device)[:, None] - torch.arange(T, device=q.device)  # query minus key position
        allowed = d >= 0 if self.causal else torch.ones_like(d, dtype=torch.bool)
        if self.window is not None:
            allowed = allowed & (d < self.window) & (d > -self.window)
        allowed = allowed[None, None]  # [1, 1, T, T]
        if mask is not None:
            allowed = allowed & mask[:, None, None, :]
            allowed = allowed | torch.eye(T, dtype=torch.bool, device=q.device)  # padding rows
        return self._attend(q, k, v, allowed), None

    def adopt_stream_window(self, window):
        """An unwindowed layer streams over the caller's window, so its ``forward`` must use it too."""
        if self.window is None:
            self.window = check_window(window)

    def recurrent(self, *, window=None, chunk=1):
        self.check_recurrent()
        w = self.window or check_window(window)
        if w is None:
            raise ValueError(f"{type(self).__name__} without a window streams over a bounded one: build it with "
                             "window=w or pass recurrent(window=w) (the DT step passes 3K - 1)")
        return SoftmaxRecurrent(self, w, check_int("chunk", chunk, low=1))


class SoftmaxRecurrent(Recurrent):
    """The recurrent form over a ``window`` of w positions, on a ring of R = w + chunk - 1 slots: state ``k``,
    ``v`` [H, R, d_head], ``valid`` [R] and ``pos`` [] int64, the row's ring phase (zero at a fresh or restarted
    row: no clock outside the row). A ring takes the chunk into its slots (``write``: one copy) where appending
    and dropping the oldest copies the cache twice. ``valid`` and ``pos`` follow the chunks and their mask alone,
    so the rings of one size in a stack ``share`` them (one pair of state tensors per stack, not per layer)."""

    def __init__(self, attn: SoftmaxAttention, window: int, chunk: int = 1):
        H, d, R = attn.n_heads, attn.d_head, window + chunk - 1
        dtype = attn.qkv.weight.dtype
        super().__init__([StateSpec("k", (H, R, d), dtype, masked_by="valid"),
                          StateSpec("v", (H, R, d), dtype, masked_by="valid"),
                          StateSpec("valid", (R,), torch.bool, shared=f"ring{window}+{chunk}"),
                          StateSpec("pos", (), torch.int64, shared=f"ring{window}+{chunk}")])
        self.attn, self.window, self.chunk, self.slots = attn, window, chunk, R

    def write(self, ring, at, new):
        """``ring`` [B, H, R, d] with the chunk's ``new`` [B, H, C, d] in its slots ``at`` [B, 1, C, 1], as a copy:
        the form is a pure function of its state. A runtime that knows more about the state than the form does
        replaces this on the form (``agents.ring_writes``: in place for the torch agent, which never reads a
        state twice; one ScatterND operator in an ONNX export)."""
        return ring.scatter(2, at.expand_as(new), new)

    def forward(self, x, state, mask=None, last_only: bool = False):
        a = self.attn
        C = static(x.shape[1])  # (static: constants in a traced graph, batch aside)
        if C > self.chunk:
            return stream_in_pieces(self, x, state, mask, last_only, self.chunk)
        K, V, valid, pos = state
        H, d, R, dev = a.n_heads, a.d_head, self.slots, x.device
        q, k, v = a.qkv(x).view(-1, C, 3 * H, d).transpose(1, 2).split(H, 1)
        real = torch.ones_like(x[..., 0], dtype=torch.bool) if mask is None else mask
        at = (pos.view(-1, 1, 1, 1) + torch.arange(C, device=dev).view(-1, 1)) % R  # [B, 1, C, 1]: the chunk's slots
        # (k, v in the ring's dtype: under autocast the projection computes in another)
        K, V = self.write(K, at, k.to(K.dtype)), self.write(V, at, v.to(V.dtype))
        valid = valid.scatter(1, at.view(-1, C), real)
        if last_only:
            q, at = q[:, :, -1:], at[:, :, -1:]
        # query i lies (at[i] - j) mod R tokens after the one in slot j (R = w + C - 1: a slot written after it
        # reads R - C + 1 >= w or more); it sees the valid slots less than w back
        back = (at - torch.arange(R, device=dev)) % R  # [B, 1, C, R]
        y = ring_attention(q, K, V, (back < self.window) & valid.view(-1, 1, 1, R))
        y = a.proj(y.transpose(1, 2).reshape(-1, static(q.shape[2]), a.d_model))
        return y, (K, V, valid, (pos + C) % R)
