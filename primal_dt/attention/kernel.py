"""Kernel-smoother attention (Tsai, Bai, Yamada, Morency, Salakhutdinov, EMNLP 2019,
"Transformer Dissection: A Unified Understanding of Transformer's Attention via the Lens of Kernel").

    out(x_i) = sum_{j in M(i)} k(x_i, x_j) v(x_j) / sum_{j' in M(i)} k(x_i, x_j')

M(i) = the set filter: real tokens (and j <= i when causal). Per head, with q = x Wq, k = x Wk:

    kernel-linear-*       <q_i, k_j>
    kernel-polynomial-*   <q_i, k_j>^2
    kernel-exponential-*  exp(<q_i, k_j> / sqrt(d))                (= softmax attention)
    kernel-rbf-*          exp(-||q_i - k_j||^2 / sqrt(d))
    *-asym: Wq != Wk;   *-sym: Wq = Wk (one projection, a symmetric kernel)
    kernel-positional     exp(<f_i WF, f_j WF>/sqrt(d)) * exp(<t_i WT, t_j WT>/sqrt(d)), values from f

The last is the paper's recommended product of symmetric kernels: f = the layer input (no position added),
t = sinusoidal embedding of the token's index among real tokens (so padding shifts nothing), values v = f WV.
A product of exponentials is one exponential of the augmented features [f WF, t WT]: the exponential path.

Numerics: exponential kernels are evaluated in the log domain (a masked softmax); the others divide by the
kernel sum + eps. The linear kernel can be negative, so its literal normaliser can cross zero and the weights
blow up (the paper reports it does not converge): its weights are divided by sum_j |<q_i, k_j>| + eps, which
keeps them bounded (|w| <= 1) and is identical for the non-negative kernels.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import Attention, ProjectedAttention, StateSpec, zero_padding
from .registry import register


def sinusoidal(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding [*, dim] of (float) positions [*] (Vaswani et al.)."""
    half = (dim + 1) // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=pos.device, dtype=pos.dtype) / half)
    ang = pos[..., None] * freq
    return torch.cat([ang.sin(), ang.cos()], dim=-1)[..., :dim]


class KernelSmootherAttention(Attention):
    """One kernel-smoother core for every kernel-* variant (class attributes pick the variant)."""

    supports_step = True
    kernel: str = "exponential"
    symmetric: bool = False
    positional: bool = False

    def __init__(self, d_model: int, n_heads: int, causal: bool = False, eps: float = 1e-6, bias: bool = True):
        super().__init__(d_model, n_heads, causal)
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.eps = float(eps)
        n_qk = 1 if (self.symmetric or self.positional) else 2
        self.qk = nn.Linear(d_model, n_qk * d_model, bias=bias)  # WF for the positional form
        self.pos_proj = nn.Linear(d_model, d_model, bias=bias) if self.positional else None  # WT
        self.v = nn.Linear(d_model, d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def _features(self, x, mask, offset):
        """(qf, kf, v) per head; offset [B] = real tokens before x (positional form)."""
        qk = self.qk(x)
        if self.symmetric or self.positional:
            qf = kf = self.split_heads(qk)
        else:
            qf, kf = map(self.split_heads, qk.split(self.d_model, dim=-1))
        if self.positional:
            m = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask
            pos = torch.cumsum(m.long(), 1) - 1 + offset[:, None]
            t = self.split_heads(self.pos_proj(sinusoidal(pos.to(x.dtype), self.d_model)))
            qf = kf = torch.cat([qf, t], dim=-1)
        return qf, kf, self.split_heads(self.v(x))

    def _attend(self, qf, kf, v, allowed):
        dots, d = qf @ kf.transpose(-1, -2), self.d_head
        if self.kernel in ("exponential", "rbf"):
            logk = dots / math.sqrt(d)
            if self.kernel == "rbf":  # -||q - k||^2 / sqrt(d); the ||q||^2 term is constant per row but kept
                logk = (2 * dots - qf.pow(2).sum(-1, keepdim=True) - kf.pow(2).sum(-1).unsqueeze(-2)) / math.sqrt(d)
            w = torch.softmax(logk.masked_fill(~allowed, torch.finfo(logk.dtype).min), dim=-1) * allowed
        else:
            kmat = (dots if self.kernel == "linear" else dots.pow(2)) * allowed
            w = kmat / (kmat.abs().sum(-1, keepdim=True) + self.eps)
        return self.proj(self.merge_heads(w @ v))

    def _allowed(self, mask, Tq, Tk, device):
        allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=device)
        if self.causal:
            allowed = allowed.tril(Tk - Tq)
        allowed = allowed[None, None]
        return allowed if mask is None else allowed & mask[:, None, None, :]

    # the forms of any mechanism whose ``run(x, mask, state)`` takes the state its ``specs`` declare
    forward = ProjectedAttention.forward
    recurrent = ProjectedAttention.recurrent

    def specs(self, dtype):
        """a cache of every token: features ``k`` [H, n, e], ``v`` [H, n, d], ``m`` [n] bool (real; n grows with the
        sequence), and ``count`` [] int64, the real tokens (the positional form's positions)"""
        H, d = self.n_heads, self.d_head
        return [StateSpec("k", (H, 0, 2 * d if self.positional else d), dtype), StateSpec("v", (H, 0, d), dtype),
                StateSpec("m", (0,), torch.bool), StateSpec("count", (), torch.int64)]

    def run(self, x, mask, state):
        """x [B, T, D] -> (y [B, T, D], state), the queries attending over the ``state``'s cache too."""
        T = x.shape[1]
        if state is None:
            qf, kf, v = self._features(x, mask, torch.zeros(x.shape[0], dtype=torch.long, device=x.device))
            return zero_padding(self._attend(qf, kf, v, self._allowed(mask, T, T, x.device)), mask), None
        K, V, M, count = state
        m = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask
        qf, kf, v = self._features(x, m, count)
        K, V, M = torch.cat([K, kf], 2), torch.cat([V, v], 2), torch.cat([M, m], 1)
        y = zero_padding(self._attend(qf, K, V, self._allowed(M, T, K.shape[2], x.device)), mask)
        return y, (K, V, M, count + m.sum(1))


def _variant(name: str, kernel: str, symmetric: bool, positional: bool = False):
    """Register ``name``: a subclass whose class attributes pick the variant (module docstring)."""
    cls_name = "Kernel" + "".join(p.title() for p in name.split("-")[1:]) + "Attention"
    attrs = {"kernel": kernel, "symmetric": symmetric, "positional": positional, "__module__": __name__}
    globals()[cls_name] = register(name)(type(cls_name, (KernelSmootherAttention,), attrs))


for _k in ("linear", "polynomial", "exponential", "rbf"):
    _variant(f"kernel-{_k}-asym", _k, False)
    _variant(f"kernel-{_k}-sym", _k, True)
_variant("kernel-positional", "exponential", True, positional=True)
