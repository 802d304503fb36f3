"""masked_attention vs an explicit per-query softmax oracle."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.ops import masked_attention


def naive_attention(q, k, v, mask, scale, softcap=None):
    """Plain python: loop over (batch, head, query), softmax over visible keys only."""
    bsz, hq, t, _ = q.shape
    hkv, s, dv = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    out = torch.zeros(bsz, hq, t, dv, dtype=torch.float64)
    for b in range(bsz):
        for h in range(hq):
            kv = h // group
            for i in range(t):
                keys = [j for j in range(s) if bool(mask[b, i, j])]
                if not keys:
                    continue
                scores = []
                for j in keys:
                    sc = float(torch.dot(q[b, h, i].double(), k[b, kv, j].double())) * scale
                    if softcap is not None:
                        sc = softcap * math.tanh(sc / softcap)
                    scores.append(sc)
                m = max(scores)
                w = [math.exp(sc - m) for sc in scores]
                tot = sum(w)
                for wj, j in zip(w, keys):
                    out[b, h, i] += (wj / tot) * v[b, kv, j].double()
    return out


def _inputs(seed, bsz, hkv, group, t, s, d, dv, dtype=torch.float64, p_visible=0.6):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, hkv * group, t, d, generator=g, dtype=dtype)
    k = torch.randn(bsz, hkv, s, d, generator=g, dtype=dtype)
    v = torch.randn(bsz, hkv, s, dv, generator=g, dtype=dtype)
    mask = torch.rand(bsz, t, s, generator=g) < p_visible
    return q, k, v, mask


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bsz=st.integers(1, 2),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    t=st.integers(1, 5),
    s=st.integers(1, 7),
    d=st.integers(1, 6),
    dv=st.integers(1, 5),
    softcap=st.sampled_from([None, 0.7, 30.0]),
    p_visible=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
)
def test_matches_naive(seed, bsz, hkv, group, t, s, d, dv, softcap, p_visible):
    q, k, v, mask = _inputs(seed, bsz, hkv, group, t, s, d, dv, p_visible=p_visible)
    scale = d**-0.5
    out = masked_attention(q, k, v, mask, scale, softcap=softcap)
    assert out.shape == (bsz, hkv * group, t, dv) and out.dtype == q.dtype
    torch.testing.assert_close(out, naive_attention(q, k, v, mask, scale, softcap), rtol=1e-9, atol=1e-10)


def test_float32_and_causal_mask():
    q, k, v, _ = _inputs(0, 2, 2, 2, 6, 6, 8, 8, dtype=torch.float32)
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 6, 6)
    out = masked_attention(q, k, v, mask, 0.35)
    ref = naive_attention(q, k, v, mask, 0.35)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # agrees with torch's SDPA for the MHA case after repeating kv heads
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask[:, None], scale=0.35
    )
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


def test_gqa_equals_repeated_kv():
    q, k, v, mask = _inputs(1, 2, 2, 4, 5, 9, 4, 3, dtype=torch.float32)
    out = masked_attention(q, k, v, mask, 0.5)
    rep = masked_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), mask, 0.5)
    torch.testing.assert_close(out, rep, rtol=1e-6, atol=1e-6)


def test_all_masked_rows_are_exact_zeros():
    q, k, v, mask = _inputs(2, 2, 1, 2, 4, 5, 4, 4, dtype=torch.float32, p_visible=1.0)
    mask[0, 1] = False
    mask[1] = False
    out = masked_attention(q, k, v, mask, 1.0, softcap=5.0)
    assert torch.isfinite(out).all()
    assert (out[0, :, 1] == 0).all() and (out[1] == 0).all()
    assert (out[0, :, 0].abs() > 0).any()


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), float("-inf")])
def test_garbage_in_masked_slots_does_not_leak(garbage):
    q, k, v, _ = _inputs(3, 2, 2, 2, 3, 6, 4, 5, dtype=torch.float32)
    mask = torch.ones(2, 3, 6, dtype=torch.bool)
    mask[:, :, 4:] = False  # slots 4, 5 never visible (e.g. unused cache slots)
    mask[0, 0, 1] = False  # slot 1 hidden from one query only
    mask[1, 2, :] = False  # an all-masked row
    clean = masked_attention(q, k, v, mask, 0.5)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 4:] = garbage
    v2[:, :, 4:] = garbage
    k2[0, :, 1] = garbage  # only the key: query 0 of batch 0 must not notice
    dirty = masked_attention(q, k2, v2, mask, 0.5)
    assert torch.isfinite(dirty[0, :, 0]).all()
    torch.testing.assert_close(dirty[0, :, 0], clean[0, :, 0])
    torch.testing.assert_close(dirty[1], clean[1])
    assert (dirty[1, :, 2] == 0).all()


def test_low_precision_dtype_and_grad():
    q, k, v, mask = _inputs(4, 1, 2, 2, 4, 6, 8, 8, dtype=torch.float32)
    ref = masked_attention(q, k, v, mask, 0.3)
    out = masked_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    qg = q.clone().requires_grad_()
    masked_attention(qg, k, v, mask, 0.3).sum().backward()
    assert torch.isfinite(qg.grad).all()


def test_shape_errors():
    q, k, v, mask = _inputs(5, 1, 2, 1, 2, 3, 4, 4, dtype=torch.float32)
    with pytest.raises(ValueError):
        masked_attention(q[:, :1], k, v, mask, 1.0)  # Hq=1 not multiple of Hkv=2
    with pytest.raises(TypeError):
        masked_attention(q, k, v, mask.float(), 1.0)
