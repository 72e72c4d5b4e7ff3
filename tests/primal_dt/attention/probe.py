"""Read a mechanism's attention matrix through its own ``forward`` (no second implementation to trust): one
that mixes values computes y_i = sum_j A_ij v_j per head, linear in v, so one-hot values read A column by
column; Primal-Attention's scores e = We^T phi(q), r = Wr^T phi(k) are linear in the projection directions,
so one-hot directions read phi(q), phi(k) and A = phi(q) phi(k)^T. The tests compare what it reads with the
formulas (naive.py) and then use it to check mechanisms whose matrix is only defined by a formula.

Where it reads: the values are the last d_model outputs of the mechanism's ``qkv`` (or ``v``) projection;
Primal-Attention's scores are linear in its projection directions ``W`` [2, H, rows, s].
"""

from __future__ import annotations

import torch

from primal_dt.attention.primal import PrimalAttention


@torch.no_grad()
def attention_matrix(attn, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, H, T, T]: the attention matrix of ``attn`` on its input x [B, T, D] (this module's docstring), d_head (or
    s) one-hot columns per call; rows and columns of padding are zero."""
    B, T, D = x.shape
    H = attn.n_heads
    if not isinstance(attn, PrimalAttention):  # one-hot values: token start + c's value is e_c in every head
        d, A = attn.d_head, x.new_zeros(B, H, T, T)
        for start in range(0, T, d):
            n = min(d, T - start)
            onehot = x.new_zeros(T, H, d)
            onehot[start + torch.arange(n), :, torch.arange(n)] = 1
            mixed = _mixed_with_values(attn, x, mask, onehot.view(T, D))  # A_h[i, start + c] at (i, h, c)
            A[..., start:start + n] = mixed.view(B, T, H, d)[..., :n].transpose(1, 2)
    else:  # one-hot projection directions: the scores are the features the kernel is built from
        W = attn.W
        rows, s = W.shape[2:]
        feats = []
        for start in range(0, rows, s):
            n = min(s, rows - start)
            onehot = torch.zeros_like(W)
            onehot[:, :, start + torch.arange(n), torch.arange(n)] = 1
            _, aux = torch.func.functional_call(attn, {"W": onehot}, (x, mask))
            feats.append(torch.stack([aux["e"][..., :n], aux["r"][..., :n]]))
        fq, fk = torch.cat(feats, -1)  # [B, H, T, rows] each
        A = fq @ fk.transpose(-1, -2)
    if mask is not None:
        A = A * (mask[:, None, :, None] & mask[:, None, None, :]).to(A.dtype)
    return A


def _mixed_with_values(attn, x, mask, values):
    """The input of ``attn.proj`` (the heads' outputs, merged) when ``forward(x, mask)`` runs with its
    values, the last d_model outputs of its ``qkv`` (or ``v``) projection, replaced by ``values`` [T, D] in every row."""
    seen = []

    def substitute(module, args, out):
        out = out.clone()
        out[..., -values.shape[-1]:] = values
        return out

    values_from = attn.qkv if hasattr(attn, "qkv") else attn.v
    with (values_from.register_forward_hook(substitute),
          attn.proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))):
        attn(x, mask)
    return seen[-1]
