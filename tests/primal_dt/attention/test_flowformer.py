"""Flow-Attention against its flow equations written with explicit per-token sums."""

import pytest
import torch

from primal_dt.attention import build_attention

D, H = 12, 3
MASK = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)


def naive_flow(a, x, mask):
    B, T, _ = x.shape
    dh = D // H
    q, k, v = a.qkv(x).split(D, -1)
    out = torch.zeros(B, T, D, dtype=x.dtype)
    for b in range(B):
        real = [t for t in range(T) if mask is None or mask[b, t]]
        for h in range(H):
            sl = slice(h * dh, (h + 1) * dh)
            fq = {t: torch.sigmoid(q[b, t, sl]) for t in real}
            fk = {t: torch.sigmoid(k[b, t, sl]) for t in real}
            vv = {t: v[b, t, sl] for t in real}
            res = {}
            if not a.causal:
                n = len(real)
                I = {i: fq[i] @ sum(fk[j] for j in real) for i in real}
                O = {j: fk[j] @ sum(fq[i] for i in real) for j in real}
                Ih = {i: fq[i] @ sum(fk[j] / O[j] for j in real) for i in real}
                Oh = {j: fk[j] @ sum(fq[i] / I[i] for i in real) for j in real}
                e = {j: torch.exp(Oh[j].clamp(-1, 1)) for j in real}
                c = {j: n * e[j] / sum(e.values()) for j in real}
                for i in real:
                    agg = sum((fq[i] @ fk[j]) * c[j] * vv[j] for j in real) / I[i]
                    res[i] = torch.sigmoid(Ih[i]) * agg
            else:
                I, O, Ih, Oh, e, c = {}, {}, {}, {}, {}, {}
                for pos, t in enumerate(real):  # in order, so each quantity uses the prefix only
                    pre = real[: pos + 1]
                    n = len(pre)
                    I[t] = fq[t] @ sum(fk[j] for j in pre) / n
                    O[t] = fk[t] @ sum(fq[j] for j in pre) / n
                    Ih[t] = fq[t] @ sum(fk[j] / O[j] for j in pre) / n
                    Oh[t] = fk[t] @ sum(fq[j] / I[j] for j in pre) / n
                    e[t] = torch.exp(Oh[t].clamp(-1, 1))
                    c[t] = n * e[t] / sum(e[j] for j in pre)
                    agg = sum((fq[t] @ fk[j]) * c[j] * vv[j] for j in pre) / (n * I[t])
                    res[t] = torch.sigmoid(Ih[t]) * agg
            for t in real:
                out[b, t, sl] = res[t]
    return a.proj(out) * (torch.ones(B, T, 1) if mask is None else mask[..., None].to(x.dtype))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_flow_equations(causal, masked):
    torch.manual_seed(0)
    a = build_attention("flowformer", D, H, causal=causal, chunk=3).eval()
    x = torch.randn(2, 7, D)
    mask = MASK if masked else None
    with torch.no_grad():
        y, _ = a(x, mask)
        ref = naive_flow(a, x, mask)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="eps"):
        build_attention("flowformer", D, H, eps=0.0)
    with pytest.raises(ValueError, match="chunk"):
        build_attention("flowformer", D, H, chunk=0)
