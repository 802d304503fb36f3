"""Learned attention sinks (GPT-OSS, GraniteSWA) in masked_attention and AttentionMixer, against a naive oracle:
per query head, the softmax over [visible scores..., sink] with the sink column dropped before the weighted sum."""

from __future__ import annotations

import math

import pytest
import torch

from hybridcache.ops import masked_attention


def naive_sink_attention(q, k, v, mask, scale, sinks):
    """Loops over batch, head and query: softmax of the visible scores plus one extra logit, in float64."""
    b, hq, t, _ = q.shape
    hkv, s = k.shape[1], k.shape[2]
    out = torch.zeros(b, hq, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            for i in range(t):
                m = mask[bi, kv, i] if mask.dim() == 4 else mask[bi, i]
                idx = [j for j in range(s) if m[j]]
                logits = [float(q[bi, h, i].double() @ k[bi, kv, j].double()) * scale for j in idx]
                denom = sum(math.exp(x) for x in logits) + math.exp(float(sinks[h]))
                for x, j in zip(logits, idx, strict=True):
                    out[bi, h, i] += math.exp(x) / denom * v[bi, kv, j].double()
    return out


def _case(t: int, s: int, per_head: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, d = 2, 4, 2, 8
    q, k, v = (torch.randn(b, n, m, d, generator=g) for n, m in ((hq, t), (hkv, s), (hkv, s)))
    causal = torch.arange(s)[None, :] <= (torch.arange(t)[:, None] + s - t)  # [T, S]
    mask = causal[None].expand(b, t, s).clone()
    mask[1, :, :2] = False  # left padding in row 1
    if per_head:
        mask = mask[:, None].expand(b, hkv, t, s).clone()
        mask[0, 1, :, 0] = False  # a kv head that dropped a token
    sinks = torch.randn(hq, generator=g) * 2
    return q, k, v, mask, sinks


@pytest.mark.parametrize("t", [1, 5])  # a decode step (the kernel's shape) and a prefill block (SDPA's shape)
@pytest.mark.parametrize("per_head", [False, True])
def test_sink_attention_matches_naive_oracle(t, per_head):
    q, k, v, mask, sinks = _case(t, 7, per_head)
    want = naive_sink_attention(q, k, v, mask, 0.3, sinks)
    got = masked_attention(q, k, v, mask, 0.3, sinks=sinks)
    assert (got.double() - want).abs().max() < 1e-5
    got_w, weights = masked_attention(q, k, v, mask, 0.3, sinks=sinks, return_weights=True)
    assert torch.equal(got_w, got)
    assert (weights.sum(-1) < 1).all()  # the sink takes some of the mass


def test_sink_attention_query_that_sees_nothing_gives_zeros():
    q, k, v, mask, sinks = _case(3, 5, False)
    mask[0, 1] = False  # query 1 of row 0 sees nothing
    mask[0, :, 0] = False
    k[0, :, 0] = float("nan")  # garbage in a slot no query of row 0 sees
    out = masked_attention(q, k, v, mask, 0.5, sinks=sinks)
    assert torch.isfinite(out).all() and (out[0, :, 1] == 0).all()


def test_very_negative_sinks_give_plain_attention():
    q, k, v, mask, sinks = _case(4, 6, False)
    plain = masked_attention(q, k, v, mask, 0.4)
    assert torch.allclose(masked_attention(q, k, v, mask, 0.4, sinks=torch.full_like(sinks, -1e4)), plain, atol=1e-6)
