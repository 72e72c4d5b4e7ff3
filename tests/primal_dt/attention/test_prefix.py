"""Masked running sums and means (``primal_dt.attention.prefix``) against the formula, by both of their ways to a
windowed sum: the banded product (short sequences) and the difference of float64 cumulative sums (long ones)."""

import pytest
import torch

from primal_dt.attention import prefix


def formula(x, mask, window):
    """Position t: the sum of x_j over real j with t - window < j <= t (or j <= t), a loop."""
    B, T = x.shape[:2]
    out = torch.zeros_like(x, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for j in range(max(0, t - window + 1) if window else 0, t + 1):
                if mask is None or mask[b, j]:
                    out[b, t] += x[b, j].double()
    return out


@pytest.mark.parametrize("banded", [True, False])
@pytest.mark.parametrize("window", [1, 3, 7])
def test_windowed_sums_and_means_are_the_formula_by_either_way(banded, window, monkeypatch):
    if not banded:
        monkeypatch.setattr(prefix, "BANDED_MAX", 0)  # every length takes the cumulative sums
    g = torch.Generator().manual_seed(window)
    x = torch.randn(3, 11, 2, 4, generator=g)  # [B, T, *F]
    mask = torch.rand(3, 11, generator=g) > 0.3
    mask[0] = True
    for m in (None, mask):
        want = formula(x, m, window)
        got = prefix.prefix_sums(x, m, window)
        assert got.dtype == x.dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-6)
        n = formula(torch.ones(3, 11), m, window)
        means = want / n.clamp(min=1).view(3, 11, 1, 1)
        torch.testing.assert_close(prefix.prefix_means(x, m, window).double(), means, atol=1e-5, rtol=1e-6)


def test_banded_sums_under_autocast_return_the_callers_dtype_and_the_formula():
    """Under bf16 autocast (the CPU recipe) the sums come back in the input's dtype, the formula's value to within
    bf16's rounding."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 30, 8, generator=g) * 100).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = prefix.prefix_sums(x, None, 21)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), formula(x, None, 21), atol=1e-2, rtol=2 ** -8)
