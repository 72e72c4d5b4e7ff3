"""Canonical multi-head softmax attention (Vaswani et al. 2017) on PyTorch's fused SDPA kernel.

softmax(q k^T / sqrt(d)) v per head, with padding, causal and sliding-window masks. The recurrent
form is a key/value cache, bounded to the last ``window - 1`` positions when a window is set.

Window semantics (shared with every windowed mechanism): position t sees positions
t - window < j <= t; padding inside the window is invisible but still occupies its slot.
A padding query attends to itself only (so no row is empty) and its output is zeroed.

``impl="sdpa"`` (default) uses the fused kernel (flash-style on CPU: O(T) memory);
``impl="materialized"`` forms the T x T score matrix explicitly, the canonical attention the
papers compared against (same parameters, same outputs, O(T^2) memory).

Stream form (``init_stream`` / ``stream_step``, what agents.stream runs): the cache is a
preallocated ring of ``w + chunk - 1`` slots written in place, with w the layer's window or else the
bounded window the caller passes (an unwindowed cache would grow with the sequence), and SDPA over
the whole ring with a position/validity mask whose position part is precomputed once per ring phase.

Export form (``export_form``, ``SoftmaxExport``): the same window as a pure function; the cache holds
the last ``w - 1`` positions oldest first (positions implicit in the order: no clock), a chunk attends
over cache ++ chunk through a band mask fixed by the window, and the new cache is the last w - 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Attention, ExportForm, check_int, check_window, static, stream_in_pieces, zero_padding
from .registry import register
from .state import State, StateSpec


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
        return State(rows={"k": torch.zeros(shape, device=device, dtype=dtype),
                           "v": torch.zeros(shape, device=device, dtype=dtype),
                           "m": torch.zeros(batch, 0, dtype=torch.bool, device=device)},
                     shared={"pos": 0})  # the rows' common clock: only position differences matter

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
        return y, State(rows={"k": K, "v": V, "m": M}, shared={"pos": p0 + C})

    # -- stream form: preallocated ring-buffer KV cache ------------------------------------------
    def init_stream(self, batch, *, device=None, dtype=None, window=None, chunk=1):
        """A ring of ``w + chunk - 1`` key/value slots (w = this layer's window, else the caller's
        ``window``): writing a chunk of ``chunk`` tokens then evicts only positions that none of its
        queries can see. The state holds the weights it reads (detached, so in-place updates show;
        build a new stream after replacing them)."""
        self._require_step()
        w = self.window or check_window(window)
        if w is None:
            raise ValueError(f"{type(self).__name__} without a window streams over a bounded one: build it with "
                             "window=w or pass init_stream(..., window=w) (the DT stream engine passes 3K - 1); "
                             "step() instead keeps a cache of the whole sequence")
        check_int("chunk", chunk, low=1)
        dtype = dtype or self.qkv.weight.dtype
        cap = w + chunk - 1
        shape = (batch, self.n_heads, cap, self.d_head)
        rows = {"k": torch.zeros(shape, device=device, dtype=dtype),
                "v": torch.zeros(shape, device=device, dtype=dtype),
                "valid": torch.zeros(batch, cap, dtype=torch.bool, device=device)}
        qkv, proj = self.qkv, self.proj
        shared = {"pos": 0, "window": w, "chunk": chunk, "cap": cap, "tables": {},
                  "wqkv": qkv.weight.detach(), "bqkv": None if qkv.bias is None else qkv.bias.detach(),
                  "wp": proj.weight.detach(), "bp": None if proj.bias is None else proj.bias.detach()}
        return State(rows, shared)

    @staticmethod
    def _ring_table(sh: dict, p0: int, C: int, device):
        """(slot index, position mask [C, cap], own-slot mask [C, cap]) for the chunk of C tokens starting
        at global position p0: one per ring phase and chunk length, computed once and kept in the state."""
        cap, w = sh["cap"], sh["window"]
        key = (p0 % cap, C)
        t = sh["tables"].get(key)
        if t is None:
            q_pos = torch.arange(p0, p0 + C)
            # after writing, slot j holds the latest position == j (mod cap) that is <= p0 + C - 1
            last = p0 + C - 1
            slot_pos = last - ((last - torch.arange(cap)) % cap)
            dist = q_pos[:, None] - slot_pos[None, :]
            allowed = (dist >= 0) & (dist < w)
            slots = q_pos % cap
            contiguous = bool((slots[1:] - slots[:-1] == 1).all())
            idx = slice(int(slots[0]), int(slots[-1]) + 1) if contiguous else slots.to(device)
            t = (idx, allowed.to(device), (dist == 0).to(device))
            sh["tables"][key] = t
        return t

    def stream_step(self, x, state, mask=None, last_only=False):
        """Write the chunk's keys/values into the ring in place, then SDPA of its queries (only the last
        one with ``last_only``) over the ring. Padding queries see their own slot only, so no row is
        empty; their outputs are unspecified (stream forms leave padding outputs unread). Unchecked
        arguments: the hot path of the stream engine (``step`` checks)."""
        sh, rows = state.shared, state.rows
        B, C, _ = x.shape
        if C > sh["chunk"]:
            return stream_in_pieces(self.stream_step, x, state, mask, last_only, sh["chunk"])
        p0 = sh["pos"]
        idx, allowed, own = self._ring_table(sh, p0, C, x.device)
        H, d = self.n_heads, self.d_head
        qkv = F.linear(x, sh["wqkv"], sh["bqkv"]).view(B, C, 3, H, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        K, V, valid = rows["k"], rows["v"], rows["valid"]
        K[:, :, idx] = k
        V[:, :, idx] = v
        valid[:, idx] = True if mask is None else mask
        sh["pos"] = p0 + C
        if last_only:
            q, allowed, own = q[:, :, -1:], allowed[-1:], own[-1:]
        m = (allowed.unsqueeze(0) & valid.unsqueeze(1)) | own.unsqueeze(0)
        y = F.scaled_dot_product_attention(q, K, V, attn_mask=m.unsqueeze(1))
        return F.linear(y.transpose(1, 2).reshape(B, q.shape[2], self.d_model), sh["wp"], sh["bp"]), state

    def adopt_stream_window(self, window):
        """An unwindowed layer streams over the caller's window, so its ``forward`` must use it too."""
        if self.window is None:
            self.window = check_window(window)

    # -- export form: sliding-window cache, pure ------------------------------------------------
    def export_form(self, *, window=None):
        """``SoftmaxExport`` over this layer's window, else the caller's (as ``init_stream``)."""
        self._require_step()
        w = self.window or check_window(window)
        if w is None:
            raise ValueError(f"{type(self).__name__} without a window exports over a bounded one: build it with "
                             "window=w or pass export_form(window=w) (the DT exporter passes 3K - 1)")
        return SoftmaxExport(self, w)


class SoftmaxExport(ExportForm):
    """The stream step over a ``window`` of w positions as a pure function (base.ExportForm): state
    ``k``, ``v`` [H, w - 1, d_head] and ``valid`` [w - 1], the cached positions oldest first."""

    def __init__(self, attn: SoftmaxAttention, window: int):
        H, d, L = attn.n_heads, attn.d_head, window - 1
        dtype = attn.qkv.weight.dtype
        super().__init__([StateSpec("k", (H, L, d), dtype), StateSpec("v", (H, L, d), dtype),
                          StateSpec("valid", (L,), torch.bool)])
        self.attn, self.window = attn, window

    def forward(self, x, state, mask=None, last_only: bool = False):
        a = self.attn
        K, V, valid = state
        C, L = static(x.shape[1]), self.window - 1  # (static: constants in a traced graph, batch aside)
        qkv = F.linear(x, a.qkv.weight, a.qkv.bias).view(-1, C, 3, a.n_heads, a.d_head).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        keys, values = torch.cat([K, k], 2), torch.cat([V, v], 2)
        real = torch.cat([valid, torch.ones_like(x[..., 0], dtype=torch.bool) if mask is None else mask], 1)
        # query i of the chunk sits at index L + i of cache ++ chunk and sees indices i .. L + i
        i = torch.arange(C, device=x.device)[:, None]
        j = torch.arange(L + C, device=x.device)[None, :]
        band, own = (j >= i) & (j <= i + L), j == i + L
        if last_only:
            q, band, own = q[:, :, -1:], band[-1:], own[-1:]
        allowed = (band.unsqueeze(0) & real.unsqueeze(1)) | own.unsqueeze(0)  # padding queries: own slot only
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed.unsqueeze(1), scale=a.d_head ** -0.5)
        y = F.linear(y.transpose(1, 2).reshape(-1, static(q.shape[2]), a.d_model), a.proj.weight, a.proj.bias)
        return y, (keys[:, :, C:], values[:, :, C:], real[:, C:])
