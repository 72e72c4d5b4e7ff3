"""Performer's FAVOR+ (Choromanski et al., ICLR 2021, "Rethinking Attention with Performers").

Softmax kernel exp(q^T k / sqrt(d)) estimated with m positive orthogonal random features: with
x' = x / d^(1/4) and rows w_r of Omega (blocks of orthonormal rows rescaled by chi(d) norms, so each row is
marginally N(0, I)), phi(x)_r = exp(w_r^T x' - ||x'||^2 / 2) / sqrt(m), E[phi(q)^T phi(k)] = exp(q^T k / sqrt(d)),
then the normalised linear attention of linear_core.

Numerics (exact in real arithmetic): key feature r is multiplied by exp(-||w_r||^2 / 2) and query feature r
by exp(+||w_r||^2 / 2), which leaves phi(q)^T phi(k) unchanged and makes key features exp(-||x' - w_r||^2 / 2)
<= 1 (no overflow, no dependence on other tokens, so the causal and recurrent forms stay exact); each query's
features are divided by their maximum and the 1/sqrt(m) is left out, both cancelling in the normalised ratio.

Omega is a buffer (saved in checkpoints), changed only by ``redraw()`` or, with ``redraw_every=N``, every
N-th forward call in training mode (the paper's feature redrawing).
"""

from __future__ import annotations

import math

import torch

from .base import check_int
from .linear_core import FeatureMapAttention
from .registry import register


def orthogonal_gaussian(m: int, d: int, generator=None, device=None, dtype=torch.float32) -> torch.Tensor:
    """[m, d]: blocks of d orthonormal rows (QR of Gaussian matrices), rows rescaled by chi(d) norms."""
    blocks = []
    for _ in range(math.ceil(m / d)):
        g = torch.randn(d, d, generator=generator, dtype=torch.float64)
        qmat, r = torch.linalg.qr(g)
        blocks.append((qmat * torch.sign(torch.diagonal(r))).T)  # sign fix: Haar-distributed, unbiased
    rows = torch.cat(blocks, 0)[:m]
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (rows * norms).to(device=device, dtype=dtype)


@register("performer")
class PerformerAttention(FeatureMapAttention):
    def __init__(self, d_model: int, n_heads: int, causal: bool = False, n_features: int | None = None,
                 redraw_every: int = 0, chunk: int = 64, bias: bool = True):
        super().__init__(d_model, n_heads, causal, bias=bias, chunk=chunk)
        d = self.d_head
        self.n_features = max(d, int(d * math.log(d))) if n_features is None else \
            check_int("n_features", n_features, low=1)
        self.redraw_every = check_int("redraw_every", redraw_every, low=0)
        self._calls = 0
        self.register_buffer("omega", orthogonal_gaussian(self.n_features, d))

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw a fresh Omega (in place; a running recurrent state is then stale)."""
        omega = self.omega
        omega.copy_(orthogonal_gaussian(self.n_features, self.d_head, generator, omega.device, omega.dtype))

    def forward(self, x, mask=None):
        if self.training and self.redraw_every:
            self._calls += 1
            if self._calls % self.redraw_every == 0:
                self.redraw()
        return super().forward(x, mask)

    def features(self, q, k, mask, fstate):
        scale = self.d_head ** -0.25
        w2 = 0.5 * (self.omega ** 2).sum(-1)  # ||w_r||^2 / 2, [m]
        lq = (q * scale) @ self.omega.T - 0.5 * (q * scale).pow(2).sum(-1, keepdim=True) + w2
        lk = (k * scale) @ self.omega.T - 0.5 * (k * scale).pow(2).sum(-1, keepdim=True) - w2
        fq = torch.exp(lq - lq.amax(-1, keepdim=True))
        return fq, torch.exp(lk), fstate
