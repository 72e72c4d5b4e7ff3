"""The shared linear-attention kernel against explicit sums (naive / chunk / recurrent triad)."""

import pytest
import torch

from primal_dt.attention.linear_core import linear_attention


def naive(fq, fk, v, mask, causal, eps):
    B, H, T, _ = fq.shape
    out = torch.zeros(B, H, T, v.shape[-1], dtype=fq.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                num, den = torch.zeros(v.shape[-1], dtype=fq.dtype), torch.zeros((), dtype=fq.dtype)
                for j in range(T):
                    if (mask is None or mask[b, j]) and (not causal or j <= i):
                        s = fq[b, h, i] @ fk[b, h, j]
                        num, den = num + s * v[b, h, j], den + s
                out[b, h, i] = num / (den + eps) if eps is not None else num
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("eps", [1e-6, None])
def test_parallel_matches_explicit_sums(causal, chunk, eps):
    g = torch.Generator().manual_seed(0)
    fq, fk = torch.rand(2, 2, 7, 5, generator=g), torch.rand(2, 2, 7, 5, generator=g)
    v = torch.randn(2, 2, 7, 3, generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    got = linear_attention(fq, fk, v, mask, causal, eps, chunk)
    torch.testing.assert_close(got, naive(fq, fk, v, mask, causal, eps), atol=1e-5, rtol=1e-5)


def test_recurrent_state_matches_parallel_in_chunks():
    g = torch.Generator().manual_seed(1)
    fq, fk = torch.rand(2, 2, 9, 4, generator=g), torch.rand(2, 2, 9, 4, generator=g)
    v = torch.randn(2, 2, 9, 3, generator=g)
    mask = torch.rand(2, 9, generator=g) > 0.3
    ref = linear_attention(fq, fk, v, mask, True, 1e-6, chunk=4)
    state, outs, t = torch.zeros(2, 2, 4, 3 + 1), [], 0
    for c in (1, 3, 2, 3):
        y, state = linear_attention(fq[:, :, t:t + c], fk[:, :, t:t + c], v[:, :, t:t + c], mask[:, t:t + c], True,
                                    state=state)
        outs.append(y)
        t += c
    torch.testing.assert_close(torch.cat(outs, 2), ref, atol=1e-5, rtol=1e-5)
    # the state is S = sum fk v^T with z = sum fk as its last column
    w = mask[:, None, :, None].float()
    torch.testing.assert_close(state[..., -1], (fk * w).sum(2), atol=1e-5, rtol=1e-5)
