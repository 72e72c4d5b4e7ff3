"""Reformer's LSH attention (Kitaev, Kaiser, Levskaya, ICLR 2020, "Reformer: The Efficient
Transformer"); bidirectional only.

Shared query/key projection (k_j = q_j / ||q_j||). Each of ``n_hashes`` rounds hashes every token with a
random rotation R in R^{d x b/2}: h(x) = argmax([x R ; -x R]) (b = ``n_buckets``), sorts the tokens by bucket
(stably), cuts them into chunks of ``chunk_size``; each query attends to its bucket's keys in its own chunk and
the previous one:

    y_i = sum_{j in P_i} exp(q_i^T k_j / sqrt(d) - lse_i) v_j,   P_i = same bucket, nearby in sort order

A token attends to itself only when nothing else is available (score -1e5, as in the paper). Rounds are
combined with weights softmax over rounds of lse_i (a key found in two rounds counts twice: the paper's optional
duplicate correction is not applied). O(T c) memory.

Padding is hashed to an extra bucket that sorts last, so the real tokens' order, chunks and outputs do not
depend on it; the first chunk does not look back (the reference wraps around to the last chunk, which depends
on the padded length). R is a buffer (saved with the module), redrawn only by ``redraw()``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Attention, check_int, zero_padding
from .registry import register


@register("reformer")
class ReformerAttention(Attention):
    supports_causal = False

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, n_buckets: int = 8, n_hashes: int = 2,
                 chunk_size: int = 32, bias: bool = True):
        super().__init__(d_model, n_heads, causal)
        self.n_buckets = check_int("n_buckets", n_buckets, low=2)
        if n_buckets % 2:
            raise ValueError(f"n_buckets must be even (h(x) = argmax([xR; -xR])), got {n_buckets}")
        self.n_hashes = check_int("n_hashes", n_hashes, low=1)
        self.chunk_size = check_int("chunk_size", chunk_size, low=1)
        self.qk = nn.Linear(d_model, d_model, bias=bias)
        self.v = nn.Linear(d_model, d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.register_buffer("rotations", torch.randn(n_hashes, self.d_head, n_buckets // 2))

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        self.rotations.copy_(torch.randn(self.rotations.shape, generator=generator).to(self.rotations))

    def buckets(self, qk: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[n_hashes, B, H, T] bucket ids; padding gets bucket n_buckets."""
        rot = torch.einsum("bhtd,rdk->rbhtk", qk, self.rotations.to(qk.dtype))
        b = torch.cat([rot, -rot], -1).argmax(-1)
        return b.masked_fill(~mask[None, :, None, :], self.n_buckets)

    def _round(self, q, k, v, bucket):
        """One hashing round: outputs [B, H, T, d] and log-normalisers [B, H, T]."""
        B, H, T, d = q.shape
        c = min(self.chunk_size, T)
        order = torch.sort(bucket, dim=-1, stable=True).indices  # [B, H, T]
        pad = (-T) % c
        pos = torch.arange(T, device=q.device).expand(B, H, T)

        def sort(t, fill=0):
            t = t.gather(2, order if t.dim() == 3 else order[..., None].expand(-1, -1, -1, t.shape[-1]))
            return F.pad(t, (0, 0, 0, pad) if t.dim() == 4 else (0, pad), value=fill)

        qs, ks, vs = sort(q), sort(k), sort(v)
        bs, ps = sort(bucket, fill=self.n_buckets + 1), sort(pos, fill=-1)
        n = (T + pad) // c

        def chunks(t):
            return t.reshape(B, H, n, c, *t.shape[3:])

        def look_back(t, fill):  # keys of chunk i: chunk i followed by chunk i-1 (none before chunk 0)
            prev = torch.cat([torch.full_like(t[:, :, :1], fill), t[:, :, :-1]], 2)
            return torch.cat([t, prev], 3)

        qc, bq, pq = chunks(qs), chunks(bs), chunks(ps)
        kc, vc = look_back(chunks(ks), 0), look_back(chunks(vs), 0)
        bk, pk = look_back(chunks(bs), self.n_buckets + 2), look_back(chunks(ps), -2)
        scores = qc @ kc.transpose(-1, -2) / math.sqrt(d)  # [B, H, n, c, 2c]
        is_self = pq[..., :, None] == pk[..., None, :]
        allowed = (bq[..., :, None] == bk[..., None, :]) & (bk[..., None, :] < self.n_buckets)
        scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(is_self, -1e5)
        lse = torch.logsumexp(scores, -1)
        out = torch.exp(scores - lse[..., None]) @ vc
        out, lse = out.reshape(B, H, n * c, d)[:, :, :T], lse.reshape(B, H, n * c)[:, :, :T]
        inv = torch.argsort(order, -1)  # unsort
        return out.gather(2, inv[..., None].expand(-1, -1, -1, d)), lse.gather(2, inv)

    def forward(self, x, mask=None):
        self.check_input(x, mask)
        m = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask
        q = self.split_heads(self.qk(x))
        k = F.normalize(q, dim=-1)
        v = self.split_heads(self.v(x))
        outs, lses = zip(*(self._round(q, k, v, b) for b in self.buckets(q, m)))
        w = torch.softmax(torch.stack(lses), 0)[..., None]  # [rounds, B, H, T, 1]
        y = (w * torch.stack(outs)).sum(0)
        return zero_padding(self.proj(self.merge_heads(y)), mask), {}
