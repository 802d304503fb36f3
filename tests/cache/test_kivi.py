"""KIVI storage against an independent float computation of the paper's equations and the authors' prefill / decode
branches, split invariance of what is stored, true bytes, eviction under a sliding window, crop and row selection."""

import pytest
import torch

from hybridcache.cache import CacheError
from hybridcache.cache.core.errors import CacheConfigError, CacheCropError
from hybridcache.cache.storage.kivi import KiviStorage


def fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The paper's asymmetric quantization of one group x (any shape, min / max over all of it), dequantized."""
    lo, hi = x.min(), x.max()
    step = (hi - lo) / (2**bits - 1)
    if step == 0:
        return x.clone()
    return torch.round((x - lo) / step).clamp(0, 2**bits - 1) * step + lo


def kivi_reference(k, v, prefill, bits, g, r):
    """The authors' algorithm, one token per decode step, in plain loops: what each step attends to.

    Prefill (L tokens): attends to itself unquantized; keys: the first L - L % R quantized per channel in groups of
    G tokens; values: all but the last R quantized per token in groups of G channels.
    Decode: keys join the full-precision tail, which is quantized whole once it holds R; values join theirs, whose
    oldest token is quantized once it holds R + 1. Quantized tokens are kept here already dequantized.
    """
    b, h, n, d = k.shape
    kq, vq = [], []  # dequantized [B, H, 1, D] tokens, in order
    steps = [(k[:, :, :prefill], v[:, :, :prefill])]

    def quant_keys(x):  # [B, H, m, D], m % G == 0 -> each (b, h, channel) over G tokens
        out = x.clone()
        for i in range(b):
            for j in range(h):
                for t0 in range(0, x.shape[2], g):
                    for c in range(d):
                        out[i, j, t0 : t0 + g, c] = fake_quant(x[i, j, t0 : t0 + g, c], bits)
        return [out[:, :, t : t + 1] for t in range(x.shape[2])]

    def quant_values(x):  # [B, H, m, D] -> each (b, h, token) over G channels
        out = x.clone()
        for i in range(b):
            for j in range(h):
                for t in range(x.shape[2]):
                    for c0 in range(0, d, g):
                        out[i, j, t, c0 : c0 + g] = fake_quant(x[i, j, t, c0 : c0 + g], bits)
        return [out[:, :, t : t + 1] for t in range(x.shape[2])]

    keep_k = prefill % r
    kq += quant_keys(k[:, :, : prefill - keep_k])
    k_full = [k[:, :, t : t + 1] for t in range(prefill - keep_k, prefill)]
    keep_v = min(prefill, r)
    vq += quant_values(v[:, :, : prefill - keep_v])
    v_full = [v[:, :, t : t + 1] for t in range(prefill - keep_v, prefill)]
    for t in range(prefill, n):
        k_full.append(k[:, :, t : t + 1])
        v_full.append(v[:, :, t : t + 1])
        steps.append((torch.cat(kq + k_full, dim=2), torch.cat(vq + v_full, dim=2)))
        if len(k_full) == r:
            kq += quant_keys(torch.cat(k_full, dim=2))
            k_full = []
        if len(v_full) > r:
            vq += quant_values(v_full.pop(0))
    return steps


def feed(storage, k, v, splits, keep=None):
    views, start = [], 0
    for n in splits:
        pos = torch.arange(start, start + n).expand(k.shape[0], n)
        staged = storage.prepare(k[:, :, start : start + n], v[:, :, start : start + n], pos)
        storage.commit(staged, keep)
        views.append(staged)
        start += n
    return views


def data(b=2, h=2, n=40, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, n, d, generator=g).to(dtype)
    k[..., 3] *= 20  # an outlier channel, what per-channel keys are for
    return k, torch.randn(b, h, n, d, generator=g).to(dtype)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("prefill", [3, 8, 16, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_papers_equations_exactly(bits, prefill, dtype):
    g, r, n = 4, 8, 30
    k, v = data(n=n, seed=prefill, dtype=dtype)
    want = kivi_reference(k, v, prefill, bits, g, r)
    got = feed(
        KiviStorage(2, 2, 16, dtype, bits=bits, group_size=g, residual_length=r), k, v, [prefill] + [1] * (n - prefill)
    )
    assert len(got) == len(want)
    for step, (staged, (wk, wv)) in enumerate(zip(got, want)):
        assert torch.equal(staged.keys, wk), step
        assert torch.equal(staged.values, wv), step
    assert not torch.equal(got[-1].keys, k) and torch.equal(
        got[-1].keys[:, :, -(n % r or r) :], k[:, :, -(n % r or r) :]
    )


@pytest.mark.parametrize("splits", [[40], [1] * 40, [5, 11, 1, 1, 8, 14], [17, 3, 20], [8, 8, 8, 16]])
def test_what_is_stored_depends_only_on_how_many_tokens_were_fed(splits):
    k, v = data()
    one = KiviStorage(2, 2, 16, torch.float32, bits=2, group_size=4, residual_length=8)
    other = KiviStorage(2, 2, 16, torch.float32, bits=2, group_size=4, residual_length=8)
    feed(one, k, v, [13] + [1] * 27)
    views = feed(other, k, v, splits)
    a, b = one.state(), other.state()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]) if isinstance(a[name], torch.Tensor) else a[name] == b[name], name
    last = views[-1]  # a block attends to the held history and to itself unquantized
    assert torch.equal(last.keys[:, :, -splits[-1] :], k[:, :, -splits[-1] :])


def test_bytes_are_what_is_held():
    b, h, d, g, r = 2, 3, 32, 8, 16
    k, v = data(b, h, 45, d)
    s = KiviStorage(b, h, d, torch.float32, bits=2, group_size=g, residual_length=r)
    feed(s, k, v, [45])
    kq, vq = 32, 45 - 16  # keys: floor(45 / 16) * 16 quantized; values: all but the last 16
    want = (
        b * h * (kq * d // 4 + 2 * (kq // g) * d * 4 + (45 - kq) * d * 4)  # codes, scale + min per group, tail
        + b * h * (vq * d // 4 + 2 * vq * (d // g) * 4 + r * d * 4)
    )
    assert s.nbytes() == want
    assert s.nbytes() < 2 * b * h * 45 * d * 4 / 1.8  # vs dense float32 (the 16-token tails dominate at 45)


def test_sliding_window_drops_whole_key_groups_only_once_they_left():
    g, r, w = 4, 8, 6
    k, v = data(n=40)

    def keep(pos):
        return (pos >= 0).any(0) & (pos.amax(0) > pos.amax() + 1 - w)  # the next query's window (no padding here)

    full = KiviStorage(2, 2, 16, torch.float32, bits=4, group_size=g, residual_length=r)
    windowed = KiviStorage(2, 2, 16, torch.float32, bits=4, group_size=g, residual_length=r)
    ref, got = feed(full, k, v, [9] + [1] * 31), feed(windowed, k, v, [9] + [1] * 31, keep)
    for a, b in zip(ref, got):
        s = b.pos.shape[1]  # the windowed view is a suffix of the full one, with the same numbers
        assert torch.equal(a.keys[:, :, -s:], b.keys) and torch.equal(a.values[:, :, -s:], b.values)
        assert s >= w  # every visible token is there
    st = windowed.state()
    assert st["k_start"] % g == 0 and st["k_start"] > 40 - w - g - r
    assert windowed.nbytes() < full.nbytes() / 2


def test_crop_is_exact_or_refused_and_rows_can_be_selected():
    k, v = data(n=20)
    s = KiviStorage(2, 2, 16, torch.float32, bits=2, group_size=4, residual_length=8)
    feed(s, k, v, [6])
    s.crop(4)  # nothing quantized yet: exact
    fresh = KiviStorage(2, 2, 16, torch.float32, bits=2, group_size=4, residual_length=8)
    feed(fresh, k, v, [4])
    assert all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in zip(s.state().values(), fresh.state().values())
    )
    feed(s, k[:, :, 4:], v[:, :, 4:], [16])
    before = s.state()
    with pytest.raises(CacheCropError, match="snapshot"):
        s.crop(15)
    assert s.state() is not before and all(a is b for a, b in zip(s.state().values(), before.values()))
    s.select(torch.tensor([1, 1, 0]))
    assert s.state()["k_codes"].shape[0] == 3
    assert torch.equal(s.state()["v_dense"][0], before["v_dense"][1])


def test_bad_configs_and_blocks_are_named_errors():
    with pytest.raises(CacheConfigError, match="residual_length"):
        KiviStorage(1, 1, 16, torch.float32, group_size=4, residual_length=6)
    with pytest.raises(CacheConfigError, match="group_size"):
        KiviStorage(1, 1, 16, torch.float32, group_size=5, residual_length=10)
    with pytest.raises(CacheConfigError, match="nbits"):
        KiviStorage(1, 1, 16, torch.float32, bits=3)
    s = KiviStorage(1, 1, 16, torch.float32, group_size=4, residual_length=8)
    with pytest.raises(CacheError, match="B, H, T, D"):
        s.prepare(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), torch.zeros(1, 3, dtype=torch.long))
    assert s.columns == 0
