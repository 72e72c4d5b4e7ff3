"""Nystromformer, Linformer and Reformer (bidirectional-only approximations) against their formulas."""

import math

import pytest
import torch

from primal_dt.attention import build_attention
from primal_dt.attention.nystrom import newton_schulz_pinv

D, H = 8, 2
dh = D // H
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)


def heads(t, h):
    return t[..., h * dh:(h + 1) * dh]


def softmax_attention(a, x, mask):
    q, k, v = a.qkv(x).split(D, -1)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        R = [t for t in range(x.shape[1]) if mask is None or mask[b, t]]
        for h in range(H):
            w = torch.softmax(heads(q[b, R], h) @ heads(k[b, R], h).T / math.sqrt(dh), -1)
            out[b, R, h * dh:(h + 1) * dh] = w @ heads(v[b, R], h)
    return a.proj(out) * (1 if mask is None else mask[..., None].to(x.dtype))


# -- nystrom ----------------------------------------------------------------------------------

def naive_nystrom(a, x, mask):
    q, k, v = a.qkv(x).split(D, -1)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        R = [t for t in range(x.shape[1]) if mask is None or mask[b, t]]
        n = len(R)
        m = min(a.landmarks, n)
        segs = [[R[j] for j in range(n) if j * m // n == s] for s in range(m)]
        for h in range(H):
            Q, K, V = heads(q[b], h), heads(k[b], h), heads(v[b], h)
            ql = torch.stack([Q[s].mean(0) for s in segs])
            kl = torch.stack([K[s].mean(0) for s in segs])
            sm = lambda A, B_: torch.softmax(A @ B_.T / math.sqrt(dh), -1)  # noqa: E731
            y = sm(Q[R], kl) @ torch.linalg.pinv(sm(ql, kl)) @ sm(ql, K[R]) @ V[R]
            out[b, R, h * dh:(h + 1) * dh] = y
    return a.proj(out) * (1 if mask is None else mask[..., None].to(x.dtype))


@pytest.mark.parametrize("landmarks", [3, 4])
def test_nystrom_matches_formula_with_exact_pinv(landmarks):
    torch.manual_seed(0)
    a = build_attention("nystrom", D, H, landmarks=landmarks, pinv_iters=40).double().eval()
    x = torch.randn(2, 11, D, dtype=torch.float64)
    with torch.no_grad():
        for mask in (None, MASK):
            torch.testing.assert_close(a(x, mask)[0], naive_nystrom(a, x, mask), atol=1e-6, rtol=1e-6)


def test_nystrom_with_every_token_a_landmark_is_softmax_attention():
    torch.manual_seed(0)
    a = build_attention("nystrom", D, H, landmarks=16, pinv_iters=60).double().eval()
    x = 0.3 * torch.randn(2, 11, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(a(x, MASK)[0], softmax_attention(a, x, MASK), atol=1e-6, rtol=1e-6)


def test_newton_schulz_converges_to_the_pseudo_inverse():
    A = torch.softmax(torch.randn(3, 5, 5, dtype=torch.float64), -1)
    torch.testing.assert_close(newton_schulz_pinv(A, 40), torch.linalg.pinv(A), atol=1e-8, rtol=1e-6)


def test_nystrom_bad_arguments():
    with pytest.raises(ValueError, match="landmarks"):
        build_attention("nystrom", D, H, landmarks=0)
    with pytest.raises(ValueError, match="no causal form"):
        build_attention("nystrom", D, H, causal=True)


# -- linformer --------------------------------------------------------------------------------

def naive_linformer(a, x, mask):
    q, k, v = a.qkv(x).split(D, -1)
    F_ = a.E if a.F is None else a.F
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        R = [t for t in range(x.shape[1]) if mask is None or mask[b, t]]
        for h in range(H):
            kp = sum(a.E[:, n, None] * heads(k[b, t], h) for n, t in enumerate(R))  # E K over real tokens
            vp = sum(F_[:, n, None] * heads(v[b, t], h) for n, t in enumerate(R))
            for t in R:
                w = torch.softmax(kp @ heads(q[b, t], h) / math.sqrt(dh), 0)
                out[b, t, h * dh:(h + 1) * dh] = w @ vp
    return a.proj(out) * (1 if mask is None else mask[..., None].to(x.dtype))


@pytest.mark.parametrize("share_kv", [False, True])
def test_linformer_matches_formula(share_kv):
    torch.manual_seed(0)
    a = build_attention("linformer", D, H, proj_dim=5, max_len=12, share_kv=share_kv).eval()
    x = torch.randn(2, 11, D)
    with torch.no_grad():
        for mask in (None, MASK):
            torch.testing.assert_close(a(x, mask)[0], naive_linformer(a, x, mask), atol=1e-5, rtol=1e-5)


def test_linformer_longer_than_max_len_is_an_error():
    a = build_attention("linformer", D, H, max_len=6)
    a(torch.randn(1, 8, D), torch.tensor([[True] * 6 + [False] * 2]))  # 6 real tokens fit
    with pytest.raises(ValueError, match="max_len"):
        a(torch.randn(1, 7, D))
    with pytest.raises(ValueError, match="proj_dim"):
        build_attention("linformer", D, H, proj_dim=0)


# -- reformer ---------------------------------------------------------------------------------

def naive_reformer(a, x, mask):
    """Per round: bucket by argmax([xR; -xR]), stable sort, chunk; attend within bucket, own + previous chunk."""
    B, T, _ = x.shape
    q = a.qk(x)
    v = a.v(x)
    out = torch.zeros_like(x)
    c = min(a.chunk_size, T)
    for b in range(B):
        R = [t for t in range(T) if mask is None or mask[b, t]]
        for h in range(H):
            Q, V = heads(q[b], h), heads(v[b], h)
            K = Q / Q.norm(dim=-1, keepdim=True)
            rounds = []
            for rot in a.rotations:
                xr = Q @ rot
                bucket = {t: int(torch.cat([xr[t], -xr[t]]).argmax()) for t in R}
                order = sorted(R, key=lambda t: (bucket[t], t))
                chunk = {t: n // c for n, t in enumerate(order)}
                res = {}
                for i in R:
                    cand = [j for j in R if j != i and bucket[j] == bucket[i] and chunk[j] in (chunk[i], chunk[i] - 1)]
                    keys = cand or [i]  # self only as a fallback, with the paper's score -1e5
                    s = torch.stack([Q[i] @ K[j] / math.sqrt(dh) for j in cand]) if cand else torch.tensor([-1e5], dtype=x.dtype)
                    res[i] = (torch.softmax(s, 0) @ V[keys], torch.logsumexp(s, 0))
                rounds.append(res)
            for i in R:
                lse = torch.stack([r[i][1] for r in rounds])
                out[b, i, h * dh:(h + 1) * dh] = torch.softmax(lse, 0) @ torch.stack([r[i][0] for r in rounds])
    return a.proj(out) * (1 if mask is None else mask[..., None].to(x.dtype))


@pytest.mark.parametrize("chunk_size", [2, 3, 64])
def test_reformer_matches_lsh_formula(chunk_size):
    torch.manual_seed(0)
    a = build_attention("reformer", D, H, n_buckets=4, n_hashes=2, chunk_size=chunk_size).double().eval()
    x = torch.randn(2, 11, D, dtype=torch.float64)
    with torch.no_grad():
        for mask in (None, MASK):
            torch.testing.assert_close(a(x, mask)[0], naive_reformer(a, x, mask), atol=1e-8, rtol=1e-7)


def test_reformer_padding_invariance_across_chunks():
    a = build_attention("reformer", D, H, n_buckets=2, chunk_size=2).eval()
    x = torch.randn(1, 7, D)
    ref, _ = a(x)
    xp = torch.cat([torch.randn(1, 3, D), x, torch.randn(1, 2, D)], 1)
    y, _ = a(xp, torch.tensor([[False] * 3 + [True] * 7 + [False] * 2]))
    torch.testing.assert_close(y[:, 3:10], ref, atol=1e-5, rtol=1e-5)


def test_reformer_hash_is_fixed_until_redrawn_and_bad_arguments():
    a = build_attention("reformer", D, H)
    x = torch.randn(1, 9, D)
    torch.testing.assert_close(a(x)[0], a(x)[0])
    r0 = a.rotations.clone()
    a.redraw(torch.Generator().manual_seed(1))
    assert not torch.equal(r0, a.rotations)
    with pytest.raises(ValueError, match="even"):
        build_attention("reformer", D, H, n_buckets=3)
    with pytest.raises(ValueError, match="n_hashes"):
        build_attention("reformer", D, H, n_hashes=0)
