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

Export form (``export_form``, ``SoftmaxExport``): the same ring as a pure function, each row with its
own phase in its state (no clock outside the row); a chunk is scattered into its slots (one copy of the
cache per step, the least a graph whose state comes back new can do) and attends over the ring through a
position/validity mask whose position part is a constant table row picked by the phase.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import Attention, ExportForm, check_int, check_window, static, stream_in_pieces, zero_padding
from .precision import PRECISIONS, linear, weight
from .registry import register
from .state import State, StateSpec


SDPA_BELOW = 64
"""batch x heads below which the stream's ring attention calls SDPA (see ``ring_attention``)"""


def ring_attention(q, K, V, allowed):
    """softmax(q K^T / sqrt(d), masked by ``allowed``) V for a chunk's few queries over a ring of keys.

    Each (row, head) is a [C, d] x [d, cap] product, so the work is B H tiny matmuls that read the
    whole cache: memory-bound. SDPA's CPU kernel (flash attention, built for long query blocks) spent
    1.47 ms there at batch 100, 4 heads, 3 queries, 61 slots; two batched matmuls around a masked
    softmax took 1.00 ms (one thread; 0.77 vs 0.49 ms for the top layer's single query). Below
    ``SDPA_BELOW`` rows x heads SDPA's lower per-call cost wins (0.014 vs 0.019 ms at batch 1). Every
    query sees at least its own slot, so no row of the softmax is empty."""
    if K.dtype == q.dtype and q.shape[0] * q.shape[1] < SDPA_BELOW:
        return F.scaled_dot_product_attention(q, K, V, attn_mask=allowed)
    # a bfloat16 cache (precision="bf16"): bf16 products, scores and softmax in q's dtype (no-ops otherwise)
    scores = torch.matmul(q.to(K.dtype), K.transpose(-1, -2)).to(q.dtype)
    scores = scores.mul_(q.shape[-1] ** -0.5).masked_fill_(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1).to(V.dtype), V).to(q.dtype)


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
    stream_precisions = ("fp32", "bf16")

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
    def init_stream(self, batch, *, device=None, dtype=None, window=None, chunk=1, precision="fp32"):
        """A ring of ``w + chunk - 1`` key/value slots (w = this layer's window, else the caller's
        ``window``): writing a chunk of ``chunk`` tokens then evicts only positions that none of its
        queries can see. The state holds the weights it reads (detached, so in-place updates show;
        build a new stream after replacing them). With ``precision="bf16"`` the weights are bfloat16 copies
        and the key/value ring holds bfloat16: a cached key or value is never accumulated into, only rounded
        once when written, and at batch 100 reading the whole ring every step is what the attention costs
        (``ring_attention``)."""
        self._require_step()
        self.check_stream_precision(precision)
        w = self.window or check_window(window)
        if w is None:
            raise ValueError(f"{type(self).__name__} without a window streams over a bounded one: build it with "
                             "window=w or pass init_stream(..., window=w) (the DT stream engine passes 3K - 1); "
                             "step() instead keeps a cache of the whole sequence")
        check_int("chunk", chunk, low=1)
        dtype = dtype or self.qkv.weight.dtype
        cache = PRECISIONS[precision] or dtype  # bf16: each key and value rounded once, when written
        cap = w + chunk - 1
        shape = (batch, self.n_heads, cap, self.d_head)
        rows = {"k": torch.zeros(shape, device=device, dtype=cache),
                "v": torch.zeros(shape, device=device, dtype=cache),
                "valid": torch.zeros(batch, cap, dtype=torch.bool, device=device)}
        qkv, proj = self.qkv, self.proj
        shared = {"pos": 0, "window": w, "chunk": chunk, "cap": cap, "tables": {},
                  "wqkv": weight(qkv.weight, precision), "bqkv": weight(qkv.bias, "fp32"),
                  "wp": weight(proj.weight, precision), "bp": weight(proj.bias, "fp32")}
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
        qkv = linear(x, sh["wqkv"], sh["bqkv"]).view(B, C, 3, H, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        K, V, valid = rows["k"], rows["v"], rows["valid"]
        K[:, :, idx] = k.to(K.dtype)  # (a bf16 ring: rounded here, once)
        V[:, :, idx] = v.to(V.dtype)
        valid[:, idx] = True if mask is None else mask
        sh["pos"] = p0 + C
        if last_only:
            q, allowed, own = q[:, :, -1:], allowed[-1:], own[-1:]
        m = (allowed.unsqueeze(0) & valid.unsqueeze(1)) | own.unsqueeze(0)
        y = ring_attention(q, K, V, m.unsqueeze(1))
        return linear(y.transpose(1, 2).reshape(B, q.shape[2], self.d_model), sh["wp"], sh["bp"]), state

    def adopt_stream_window(self, window):
        """An unwindowed layer streams over the caller's window, so its ``forward`` must use it too."""
        if self.window is None:
            self.window = check_window(window)

    # -- export form: the ring, pure --------------------------------------------------------------
    def export_form(self, *, window=None, chunk=1):
        """``SoftmaxExport`` over this layer's window, else the caller's, its ring sized for ``chunk``-token
        chunks (as ``init_stream``)."""
        self._require_step()
        w = self.window or check_window(window)
        if w is None:
            raise ValueError(f"{type(self).__name__} without a window exports over a bounded one: build it with "
                             "window=w or pass export_form(window=w) (the DT exporter passes 3K - 1)")
        return SoftmaxExport(self, w, chunk)


def scatter_nd(data: torch.Tensor, index: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """A copy of ``data`` with ``updates`` written at the index tuples ``index`` [..., k]: tuple n names
    ``data[n]``, a sub-tensor over data's remaining dims, which ``updates`` [..., *those dims] fills.

    In an ONNX export, one ScatterND operator, whose each tuple copies one contiguous run (a slot's d_head
    values): torch.scatter's export, ScatterElements, walks every value with its own index instead, 0.59 vs
    0.14 ms on a 6 MB key ring at batch 100 (onnxruntime, one thread; Concat + Slice took 0.27, an Identity
    0.15). Elsewhere (eager, TorchScript's trace) a clone and an index_put."""
    return (_ScatterND.apply if torch.onnx.is_in_onnx_export() else _written)(data, index, updates)


def _written(data, index, updates):
    out = data.clone()
    out[index.unbind(-1)] = updates
    return out


class _ScatterND(torch.autograd.Function):
    """``scatter_nd`` as the ONNX exporter's one ScatterND node (``symbolic``)."""

    @staticmethod
    def forward(ctx, data, index, updates):
        return _written(data, index, updates)

    @staticmethod
    def symbolic(g, data, index, updates):
        return g.op("ScatterND", data, index, updates)


class RingTables(NamedTuple):
    """``SoftmaxExport``'s constants for one chunk length C, one row per ring phase p (the slot of the
    chunk's first token); R slots, H heads, Cq queries (C, or 1 with ``last_only``)."""

    at: torch.Tensor
    """[R, C] the slots the chunk's tokens go to"""
    tuples: torch.Tensor
    """[R, H, C, 3] the same as (0, head, slot) index tuples into the [B, H, R, d] key/value ring"""
    band: torch.Tensor
    """[R, 1, Cq, R] query i may see slot j (if valid): slot j's token is 0 .. w - 1 positions before i's"""
    own: torch.Tensor
    """[R, 1, Cq, R] query i's own slot, seen even when i is padding, so that no softmax row is empty"""
    next: torch.Tensor
    """[R] the phase after the chunk"""
    row: torch.Tensor
    """[3] (1, 0, 0): a row number times it is the row's part of an index tuple"""


class SoftmaxExport(ExportForm):
    """The stream step over a ``window`` of w positions as a pure function (base.ExportForm), on a ring of
    R = w + chunk - 1 slots like the stream form's: state ``k``, ``v`` [H, R, d_head], ``valid`` [R] and
    ``pos`` [] int64, the row's ring phase: the slot its next token goes to (its tokens so far mod R, so
    bounded; zero at a fresh or restarted row, as every export state starts).

    Why a ring: a graph's state comes back as new tensors, so a step copies the cache at least once.
    Appending the chunk and dropping the oldest (Concat, then Slice) copied it twice on onnxruntime; here
    the chunk's keys and values are scattered into their slots (``scatter_nd``: one copy) and the
    attention reads the ring in slot order. At batch 100 those copies are what the cache costs beyond
    the attention's own reads (256 wide, 4 heads: 6 MB per key or value ring at K = 20, 31 MB at K = 100).

    What a query may see depends only on the row's phase and the chunk length, so the slots written, the
    position part of the mask and the next phase are rows of constant tables (``tables``) gathered by
    ``pos``: a few graph nodes per layer, and rows at any phases mix in one batch. ``chunk`` (the DT
    step's three tokens, agents.stream.CHUNK) sizes the ring; shorter chunks use it as they are, longer
    ones go in pieces (stream_in_pieces), as in the stream form."""

    def __init__(self, attn: SoftmaxAttention, window: int, chunk: int = 1):
        check_int("chunk", chunk, low=1)
        H, d, R = attn.n_heads, attn.d_head, window + chunk - 1
        dtype = attn.qkv.weight.dtype
        super().__init__([StateSpec("k", (H, R, d), dtype, masked_by="valid"),
                          StateSpec("v", (H, R, d), dtype, masked_by="valid"),
                          StateSpec("valid", (R,), torch.bool), StateSpec("pos", (), torch.int64)])
        self.attn, self.window, self.chunk, self.slots = attn, window, chunk, R
        self._tables: dict[tuple[int, bool], RingTables] = {}

    def tables(self, C: int, last_only: bool) -> RingTables:
        """The constants for chunks of C tokens (computed once). ``_ring_table``'s arithmetic for every
        phase: after the write, slot j holds the latest token == j (mod R) up to the chunk's last, ``age``
        tokens before it."""
        key = (C, last_only)
        if key not in self._tables:
            R, w, H = self.slots, self.window, self.attn.n_heads
            p = torch.arange(R).view(R, 1, 1)
            i = torch.arange(C).view(1, C, 1)
            j = torch.arange(R).view(1, 1, R)
            at = (p[:, :, 0] + torch.arange(C)) % R
            head = torch.arange(H).view(1, H, 1).expand(R, H, C)
            tuples = torch.stack([torch.zeros_like(head), head, at.view(R, 1, C).expand(R, H, C)], -1)
            age = (p + C - 1 - j) % R
            dist = age - (C - 1 - i)  # [R, C, R]: query i's position minus slot j's token's
            band, own = (dist >= 0) & (dist < w), dist == 0
            if last_only:
                band, own = band[:, -1:], own[:, -1:]
            self._tables[key] = RingTables(at, tuples, band.unsqueeze(1), own.unsqueeze(1),
                                           (torch.arange(R) + C) % R, torch.tensor([1, 0, 0]))
        return self._tables[key]

    def forward(self, x, state, mask=None, last_only: bool = False):
        a = self.attn
        C = static(x.shape[1])  # (static: constants in a traced graph, batch aside)
        if C > self.chunk:
            return stream_in_pieces(self, x, state, mask, last_only, self.chunk)
        K, V, valid, pos = state
        H, d = a.n_heads, a.d_head  # one transpose, then a split: fewer graph nodes than a 5-d permute, 3 selects
        q, k, v = F.linear(x, a.qkv.weight, a.qkv.bias).view(-1, C, 3 * H, d).transpose(1, 2).split(H, 1)
        t = RingTables(*(c.to(x.device) for c in self.tables(C, last_only)))
        real = torch.ones_like(x[..., 0], dtype=torch.bool) if mask is None else mask
        # (row, head, slot) tuples; row numbers from the mask's shape, not x's: the mask is every layer's, so
        # onnxruntime computes them once
        rows = torch.arange(real.shape[0], device=x.device).view(-1, 1, 1, 1) * t.row
        index = t.tuples.index_select(0, pos) + rows
        K, V = scatter_nd(K, index, k), scatter_nd(V, index, v)
        valid = valid.scatter(1, t.at.index_select(0, pos), real)  # (B x C flags: ScatterElements is fine)
        if last_only:
            q = q[:, :, -1:]
        allowed = (t.band.index_select(0, pos) & valid.view(-1, 1, 1, self.slots)) | t.own.index_select(0, pos)
        # by hand, not SDPA: its exported form guards fully masked rows (IsNaN, Where), which cannot occur here
        # (every query sees its own slot); fewer nodes, measurably faster at batch 1 on onnxruntime
        scores = torch.matmul(q, K.transpose(-1, -2)) * d ** -0.5
        y = torch.matmul(torch.softmax(torch.where(allowed, scores, float("-inf")), -1), V)
        y = F.linear(y.transpose(1, 2).reshape(-1, static(q.shape[2]), a.d_model), a.proj.weight, a.proj.bias)
        return y, (K, V, valid, t.next.index_select(0, pos))
