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


# ---- the decode kernel's sink column (hc_decode_attention's `sinks`) ----------------------------------------------


def _kernel_ready() -> bool:
    from hybridcache.accel import kernel_status

    return kernel_status().startswith("C kernels")


@pytest.mark.skipif(not _kernel_ready(), reason="the C kernels are not built")
@pytest.mark.parametrize(
    "b, hkv, group, s, d",
    [(3, 1, 5, 7, 3), (2, 3, 1, 1, 17), (1, 1, 2, 4500, 8), (2, 2, 3, 301, 33)],  # (4500: split over slot ranges)
)
@pytest.mark.parametrize("form", ["mask", "positions"])
def test_decode_kernel_with_sinks_matches_the_naive_oracle(b, hkv, group, s, d, form):
    from hybridcache.accel.native import kernels as ck
    from hybridcache.accel.native import op_reference
    from hybridcache.accel.native.op_registry import op

    g = torch.Generator().manual_seed(b * 1000 + s)
    hq = hkv * group
    q, k, v = torch.randn(b, hq, 1, d, generator=g), torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d)
    sinks = torch.randn(hq, generator=g) * 3
    sinks[0] = 40.0  # a sink far above every score: the output shrinks towards 0, never inf / NaN
    kpos = torch.arange(s).repeat(b, 1) - torch.randint(0, 3, (b, 1), generator=g)  # left padding
    qpos = kpos[:, -1:].clone()
    if b > 1:
        qpos[1] = -1  # a padding query: sees nothing, gets zeros
    mask = ((kpos >= 0) & (kpos <= qpos) & (qpos >= 0))[:, None]  # [B, 1, S]
    with torch.no_grad():
        if form == "mask":
            got = ck.decode_attention(q, k, v, mask, d**-0.5, None, sinks=sinks)
            args = (q, k, v, mask, None, None, "full", 0, d**-0.5, None, sinks)
        else:
            got = ck.decode_attention(q, k, v, None, d**-0.5, None, (qpos, kpos, "full", 0), sinks)
            args = (q, k, v, None, qpos, kpos, "full", 0, d**-0.5, None, sinks)
        want = naive_sink_attention(q, k, v, mask.expand(b, 1, s), d**-0.5, sinks)
        assert got is not None and torch.isfinite(got).all()
        assert (got.double() - want).abs().max() < 1e-5
        assert torch.equal(op("decode_attention")(*args), got)  # the registered op runs the kernel
        ref = op_reference.decode_attention(
            *(a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        )
        assert (ref - want).abs().max() < 1e-9  # the reference the op falls back to / is faked by
    if b > 1:
        assert (got[1] == 0).all()


def test_masked_attention_with_sinks_decodes_by_the_kernel(monkeypatch):
    """A decode step with sinks (GPT-OSS) calls the decode kernel with them (before: always the torch path)."""
    import hybridcache.nn.attention.mixer as attention_block
    from hybridcache.accel.native.op_registry import KERNELS

    calls = []
    kernel = KERNELS["decode_attention"]
    monkeypatch.setitem(KERNELS, "decode_attention", lambda *a: calls.append(a[-1]) or kernel(*a))
    q, k, v, mask, sinks = _case(1, 9, False, seed=3)
    out = attention_block.masked_attention(q, k, v, mask, 0.3, sinks=sinks)
    if _kernel_ready():
        with torch.no_grad():
            out = attention_block.masked_attention(q, k, v, mask, 0.3, sinks=sinks)
        assert len(calls) == 1 and calls[0] is sinks
    assert (out.double() - naive_sink_attention(q, k, v, mask, 0.3, sinks)).abs().max() < 1e-5
