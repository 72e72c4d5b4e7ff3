"""The streaming inference engine: one Decision-Transformer action per environment step from
per-layer recurrent states, at a cost that does not grow with the episode.

Every environment step feeds ONE chunk of three tokens through the stack,

    (a_{t-1}, R_t, s_t)          (at t = 0 the action slot is padding: masked, invisible),

and only the state token s_t's top-layer output reaches the action head; at the top layer the
other two tokens only update the layer's running statistics. Rows (episodes) advance in lock
step but restart independently (``reset_rows``): each row has its own statistics, timestep and
validity flags.

What a streamed token sees, per layer kind (the *stream semantics*):

- ``primal`` without a window: the running means of q and k over every real token of the episode
  so far (O(H d) state). This is exactly ``model.forward`` over the whole episode.
- ``primal`` / ``softmax`` with ``window=w``: the last w token positions (its own included),
  exactly as ``model.forward`` over the whole episode computes it (ring buffers of w + 2 slots).
- ``softmax`` without a window: a rolling key/value cache, treated as ``window = 3K - 1`` tokens
  (K = the model's context length). At the top layer the state token s_t then attends to exactly the
  tokens the recompute engine shows it (R, s, a of the K - 1 previous steps, then R_t, s_t); lower
  layers' outputs inside that window were themselves computed from their own windows, so the
  receptive field reaches further back than recompute's K steps. Equivalently: the stream equals
  ``model.forward`` over the whole episode on a copy of the model whose unwindowed softmax layers
  get ``window = 3K - 1`` (``streamed_model_equivalent``).
- linear-attention family (linear, performer, cosformer, kerformer, svr, kernel-*): their own
  recurrent state (prefix sums over the whole episode), i.e. ``model.forward`` over the episode.

So for every model, stream == ``streamed_model_equivalent(model).forward`` over the episode so far;
``agents.stream_training`` trains models whose training segments see the same thing.

Fast paths (pre-norm blocks, eval mode; checked against ``forward`` in tests/stream):
- primal: heads' output maps fused, ``proj(merge(Wo [We^T phi(q); Wr^T phi(k)]))`` is one
  [D, 2D] matrix applied to the normalised running sums; the running count is skipped (phi
  normalises, so the mean and the sum give the same features);
- softmax: preallocated ring-buffer KV cache written in place, SDPA over the ring with a
  position/validity mask (position masks precomputed per ring phase);
- any other mechanism: its own ``step`` and state (``Attention.reset_rows`` restarts rows).
The engine snapshots the weights it fuses: build a new engine (or agent) after the model changes.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from primal_dt.attention.base import Attention
from primal_dt.attention.primal import PrimalAttention
from primal_dt.attention.softmax import SoftmaxAttention

CHUNK = 3  # tokens per environment step: (a_{t-1}, R_t, s_t)


def softmax_stream_window(model) -> int:
    """Window used by the stream engine for a softmax layer built without one: 3K - 1 tokens."""
    return max(1, 3 * model.cfg.K - 1)


def check_streamable(model) -> None:
    """A clear error when the model has a layer without a causal recurrent form."""
    bad = [f"layer {i} ({spec.attention})" for i, (spec, b) in enumerate(zip(model.stack.specs, model.stack.blocks))
           if not (b.attn.causal and b.attn.supports_step)]
    if bad:
        raise ValueError(f"engine='stream' needs every attention layer to have a causal recurrent form; "
                         f"{', '.join(bad)} has none. Use engine='recompute' or train a model whose layers "
                         f"stream (softmax, primal, linear, performer, cosformer, ...)")
    if any(b.norm != "pre" for b in model.stack.blocks):
        raise ValueError("engine='stream' supports pre-norm blocks (the Decision Transformer's); "
                         "this stack is post-norm")


def streamed_model_equivalent(model):
    """A copy of ``model`` whose full-sequence ``forward`` equals what the stream engine computes:
    unwindowed softmax layers get the stream's bounded window (3K - 1 tokens)."""
    twin = copy.deepcopy(model).eval()
    w = softmax_stream_window(model)
    for b in twin.stack.blocks:
        if isinstance(b.attn, SoftmaxAttention) and b.attn.window is None:
            b.attn.window = w
    return twin


# -- per-layer kernels ------------------------------------------------------------------------------
class _Clock:
    """Global token positions of the lock-stepped rows (shared; only differences matter)."""

    def __init__(self):
        self.pos = 0  # position of the first token of the next chunk


class _PrimalKernel:
    """Causal Primal-Attention over running (optionally windowed) sums of q and k."""

    def __init__(self, attn: PrimalAttention, batch: int, device, dtype):
        if attn.data_dependent:
            raise ValueError("data-dependent Primal-Attention has no causal form to stream")
        D, H, d, s = attn.d_model, attn.n_heads, attn.d_head, attn.s
        self.D, self.H, self.d = D, H, d
        self.wqk = attn.qk.weight.detach()
        self.bqk = None if attn.qk.bias is None else attn.qk.bias.detach()
        with torch.no_grad():
            P = attn.proj.weight.double()
            Wo = attn.Wo.weight.double()  # [d, 2s]
            W = attn.W.double()  # [2, H, d, s]
            M = torch.zeros(D, 2 * D, dtype=torch.float64, device=P.device)
            for c in range(2):
                for h in range(H):
                    block = P[:, h * d:(h + 1) * d] @ Wo[:, c * s:(c + 1) * s] @ W[c, h].T  # [D, d]
                    M[:, c * D + h * d: c * D + (h + 1) * d] = block
            bias = torch.zeros(D, dtype=torch.float64, device=P.device)
            if attn.proj.bias is not None:
                bias += attn.proj.bias.double()
            if attn.Wo.bias is not None:
                bias += P @ attn.Wo.bias.double().repeat(H)
        self.M, self.bias = M.to(dtype), bias.to(dtype)
        self.window = attn.window
        if self.window is None:
            self.sum = torch.zeros(batch, 2 * D, device=device, dtype=dtype)
        else:  # ring of the last `window` positions' (masked) q|k, and their float64 sum
            self.cap = self.window
            self.ring = torch.zeros(batch, self.cap, 2 * D, device=device, dtype=dtype)
            self.S = torch.zeros(batch, 2 * D, device=device, dtype=torch.float64)

    def reset_rows(self, rows):
        if self.window is None:
            self.sum[rows] = 0
        else:
            self.ring[rows] = 0
            self.S[rows] = 0

    def keep_rows(self, keep):
        if self.window is None:
            self.sum = self.sum[keep]
        else:
            self.ring, self.S = self.ring[keep], self.S[keep]

    def step(self, h, mask, p0: int, last_only: bool):
        B, C, _ = h.shape
        if last_only and self.window is None:
            # only the chunk's total enters the state and only the last token is read out:
            # sum_i m_i (W h_i + b) = W (sum_i m_i h_i) + (sum_i m_i) b, one row instead of C
            if mask is None:
                hs, n = h.sum(1, keepdim=True), float(C)
            else:
                hs, n = torch.bmm(mask.unsqueeze(1), h), mask.sum(1).view(B, 1, 1)
            qk = F.linear(hs, self.wqk)
            if self.bqk is not None:
                qk = qk + n * self.bqk
            self.sum.add_(qk[:, 0])
            f = F.normalize(self.sum.view(B, 1, 2 * self.H, self.d), dim=-1, eps=1e-12)
            return F.linear(f.view(B, 1, 2 * self.D), self.M, self.bias)
        qk = F.linear(h, self.wqk, self.bqk)
        if mask is not None:
            qk = qk * mask.unsqueeze(-1)
        if self.window is None:
            sums = torch.cumsum(qk, 1).add_(self.sum.unsqueeze(1))
            self.sum.copy_(sums[:, -1])
        else:
            slots = [(p0 + i) % self.cap for i in range(C)]
            wrap = slots[-1] - slots[0] != C - 1
            idx = torch.tensor(slots, device=h.device) if wrap else slice(slots[0], slots[-1] + 1)
            old = self.ring[:, idx]  # the positions leaving the window, oldest first
            sums64 = torch.cumsum((qk - old).double(), 1).add_(self.S.unsqueeze(1))
            self.S.copy_(sums64[:, -1])
            self.ring[:, idx] = qk
            sums = sums64.to(qk.dtype)
        if last_only:
            sums = sums[:, -1:]
        f = F.normalize(sums.view(B, sums.shape[1], 2 * self.H, self.d), dim=-1, eps=1e-12)
        return F.linear(f.view(B, sums.shape[1], 2 * self.D), self.M, self.bias)


class _SoftmaxKernel:
    """Softmax attention over a preallocated ring-buffer KV cache of window + 2 slots."""

    def __init__(self, attn: SoftmaxAttention, window: int, batch: int, device, dtype):
        D, H, d = attn.d_model, attn.n_heads, attn.d_head
        self.D, self.H, self.d = D, H, d
        self.w = int(window)
        self.cap = self.w + CHUNK - 1  # writing a chunk only evicts positions no query can see
        self.wqkv = attn.qkv.weight.detach()
        self.bqkv = None if attn.qkv.bias is None else attn.qkv.bias.detach()
        self.wp = attn.proj.weight.detach()
        self.bp = None if attn.proj.bias is None else attn.proj.bias.detach()
        self.k = torch.zeros(batch, H, self.cap, d, device=device, dtype=dtype)
        self.v = torch.zeros(batch, H, self.cap, d, device=device, dtype=dtype)
        self.valid = torch.zeros(batch, self.cap, dtype=torch.bool, device=device)
        self._tables: dict = {}
        self.device = device

    def _table(self, p0: int, C: int):
        """(slot index, position mask [C, cap]) for the chunk starting at global position p0."""
        key = (p0 % self.cap, C)
        t = self._tables.get(key)
        if t is None:
            q_pos = torch.arange(p0, p0 + C)
            # after writing, slot j holds the latest position == j (mod cap) that is <= p0 + C - 1
            last = p0 + C - 1
            slot = torch.arange(self.cap)
            slot_pos = last - ((last - slot) % self.cap)
            dist = q_pos[:, None] - slot_pos[None, :]
            allowed = (dist >= 0) & (dist < self.w)
            slots = (q_pos % self.cap)
            contiguous = bool((slots[1:] - slots[:-1] == 1).all())
            idx = slice(int(slots[0]), int(slots[-1]) + 1) if contiguous else slots.to(self.device)
            t = (idx, allowed.to(self.device), (dist == 0).to(self.device))
            self._tables[key] = t
        return t

    def reset_rows(self, rows):
        self.valid[rows] = False

    def keep_rows(self, keep):
        self.k, self.v, self.valid = self.k[keep], self.v[keep], self.valid[keep]

    def step(self, h, mask, p0: int, last_only: bool):
        B, C, _ = h.shape
        idx, allowed, own = self._table(p0, C)
        qkv = F.linear(h, self.wqkv, self.bqkv).view(B, C, 3, self.H, self.d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        self.k[:, :, idx] = k
        self.v[:, :, idx] = v
        self.valid[:, idx] = True if mask is None else mask
        if last_only:
            q, allowed, own = q[:, :, -1:], allowed[-1:], own[-1:]
        # padding queries see their own slot only, so no row is empty (their outputs are unused)
        m = (allowed.unsqueeze(0) & self.valid.unsqueeze(1)) | own.unsqueeze(0)
        y = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=m.unsqueeze(1))
        return F.linear(y.transpose(1, 2).reshape(B, q.shape[2], self.D), self.wp, self.bp)


class _GenericKernel:
    """Any other causal mechanism: its own recurrent ``step`` and state dict."""

    def __init__(self, attn: Attention, batch: int, device, dtype):
        self.attn = attn
        self.state = attn.init_state(batch, device=device, dtype=dtype)

    def reset_rows(self, rows):
        Attention.reset_rows(self.state, rows)

    def keep_rows(self, keep):
        self.state = Attention.select_rows(self.state, keep)

    def step(self, h, mask, p0: int, last_only: bool):
        y, self.state = self.attn.step(h, self.state, mask)
        return y[:, -1:] if last_only else y


def _kernel(attn, model, batch, device, dtype):
    if type(attn) is PrimalAttention and (attn.window is None or attn.window >= CHUNK):
        return _PrimalKernel(attn, batch, device, dtype)
    if type(attn) is SoftmaxAttention:
        return _SoftmaxKernel(attn, attn.window or softmax_stream_window(model), batch, device, dtype)
    return _GenericKernel(attn, batch, device, dtype)


# -- the engine -------------------------------------------------------------------------------------
class StreamEngine:
    """Recurrent DT inference for ``batch`` lock-stepped rows (see the module docstring)."""

    def __init__(self, model, batch: int):
        check_streamable(model)
        if model.training:
            raise ValueError("StreamEngine needs the model in eval mode (model.eval())")
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.batch = int(batch)
        self.kernels = [_kernel(b.attn, model, self.batch, self.device, self.dtype) for b in model.stack.blocks]
        self.clock = _Clock()
        self._max_t = model.cfg.max_timestep - 1

    @torch.inference_mode()
    def reset_rows(self, rows: torch.Tensor) -> None:
        for k in self.kernels:
            k.reset_rows(rows)

    @torch.inference_mode()
    def keep_rows(self, keep: torch.Tensor) -> None:
        """Continue with the rows where ``keep`` ([B] bool) is True only, in order."""
        for k in self.kernels:
            k.keep_rows(keep)
        self.batch = int(keep.sum())

    @torch.inference_mode()
    def step(self, rtg, states, prev_actions, timesteps, first):
        """One env step for every row: rtg [B] (scaled), states [B, state_dim] (normalised),
        prev_actions [B, act_dim] (a_{t-1}; ignored where ``first``), timesteps [B] long,
        first [B] bool (rows at t = 0), or ``None`` when no row is at t = 0.
        Returns actions [B, act_dim]."""
        m = self.model
        # embeddings: (a_{t-1} at timestep t-1, R_t and s_t at timestep t), one LayerNorm
        tt = torch.stack((timesteps - 1, timesteps, timesteps), 1).clamp_(0, self._max_t)
        time = F.embedding(tt, m.embed_timestep.weight)
        a = F.linear(prev_actions, m.embed_action.weight, m.embed_action.bias)
        r = torch.addcmul(m.embed_return.bias, rtg.unsqueeze(-1), m.embed_return.weight.squeeze(-1))
        s = F.linear(states, m.embed_state.weight, m.embed_state.bias)
        x = F.layer_norm(torch.stack((a, r, s), 1) + time, (m.cfg.d_model,), m.embed_ln.weight, m.embed_ln.bias,
                         m.embed_ln.eps)
        mask = None
        if first is not None:
            mask = torch.ones(x.shape[0], CHUNK, dtype=torch.bool, device=x.device)
            mask[:, 0] = ~first
        mask_f = None if mask is None else mask.to(x.dtype)
        p0 = self.clock.pos
        blocks = m.stack.blocks
        last = len(blocks) - 1
        for i, (b, k) in enumerate(zip(blocks, self.kernels)):
            top = i == last
            h = F.layer_norm(x, (x.shape[-1],), b.ln1.weight, b.ln1.bias, b.ln1.eps)
            x = (x[:, -1:] if top else x) + k.step(h, mask_f if isinstance(k, _PrimalKernel) else mask, p0, top)
            x = x + b.mlp(F.layer_norm(x, (x.shape[-1],), b.ln2.weight, b.ln2.bias, b.ln2.eps))
        self.clock.pos = p0 + CHUNK
        return m.predict_action(m.stack.ln_f(x[:, -1]))
