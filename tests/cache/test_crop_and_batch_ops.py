"""crop, reorder, select and repeat on attention layers, checked by continuing against naive attention."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridcache.cache import CacheCropError
from tests.cache.oracle import masked_attention, naive_attention, row_positions
from tests.cache.test_attention_exact import make_layer


def feed_blocks(layer, q, k, v, valid, bounds):
    """Feed columns bounds[0]..bounds[-1]; return attention outputs per column range."""
    outs = []
    for c0, c1 in zip(bounds[:-1], bounds[1:]):
        view = layer.update(k[:, :, c0:c1], v[:, :, c0:c1], valid[:, c0:c1])
        outs.append(masked_attention(q[:, :, c0:c1], view.keys, view.values, view.mask))
    return torch.cat(outs, dim=2)


def assert_close_on_real(got, expected, valid):
    real = valid[:, None, :, None].expand_as(got)
    diff = (got.double() - expected).abs()[real]
    assert diff.numel() == 0 or diff.max() <= 1e-5, diff.max()


@given(
    pattern=st.sampled_from(["full", "sliding", "chunked"]),
    param=st.integers(1, 6),
    n=st.integers(2, 20),
    data=st.data(),
    static=st.booleans(),
)
def test_crop_is_exact_or_refused_without_change(pattern, param, n, data, static):
    pads = [data.draw(st.integers(0, n - 1)), 0]
    m = data.draw(st.integers(0, n))  # crop to m columns
    extra = data.draw(st.integers(1, 6))  # then feed this many new columns
    g = torch.Generator().manual_seed(n)
    total = n + extra
    q, k, v = (torch.randn(2, 1, total, 2, generator=g) for _ in range(3))
    k2, v2 = (torch.randn(2, 1, extra, 2, generator=g) for _ in range(2))
    valid = torch.tensor(row_positions(pads, total)) >= 0
    layer = make_layer(pattern, param, 1, 2, 2, max_length=total if static else None)
    split = data.draw(st.integers(1, n))
    feed_blocks(layer, q, k, v, valid, [0, split, *range(split + 1, n + 1)] if split < n else [0, n])
    before = layer.snapshot()
    try:
        layer.crop(m)
    except CacheCropError:
        assert pattern != "full", "full attention holds everything and can always crop"
        after = layer.snapshot()
        assert after.columns == before.columns
        assert all(torch.equal(before.tensors[t], after.tensors[t]) for t in before.tensors)
        return
    # continue after the crop: the sequence is now columns [0, m) followed by k2/v2
    kk, vv = torch.cat([k[:, :, :m], k2], 2), torch.cat([v[:, :, :m], v2], 2)
    qq = q[:, :, : m + extra]
    valid2 = torch.tensor(row_positions(pads, m + extra)) >= 0
    pads2 = [min(p, m + extra) for p in pads]
    expected, _ = naive_attention(qq, kk, vv, pads2, pattern, param)
    got = feed_blocks(layer, qq, kk, vv, valid2, [m, *range(m + 1, m + extra + 1)])
    assert_close_on_real(got, expected[:, :, m:], valid2[:, m:])


def test_crop_where_tokens_are_held_and_refusal_otherwise():
    full = make_layer("full", 1, 1, 2, 1)
    full.update(torch.randn(1, 1, 10, 2), torch.randn(1, 1, 10, 2))
    full.crop(3)
    assert full.columns == 3 and full.keys.shape[2] == 3 and full.seen.tolist() == [3]
    ring = make_layer("sliding", 4, 1, 2, 1, max_length=32)  # ring of W slots keeps one spare token
    for _ in range(10):
        ring.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    ring.crop(9)
    with pytest.raises(CacheCropError, match="only 2 are still held"):
        ring.crop(8)
    dynamic = make_layer("sliding", 4, 1, 2, 1)
    dynamic.update(torch.randn(1, 1, 10, 2), torch.randn(1, 1, 10, 2))
    with pytest.raises(CacheCropError, match="evicted by the sliding pattern"):
        dynamic.crop(9)
    chunked = make_layer("chunked", 4, 1, 2, 1)
    chunked.update(torch.randn(1, 1, 10, 2), torch.randn(1, 1, 10, 2))
    chunked.crop(9)  # position 8 starts the chunk [8, 12): nothing before it is needed
    chunked.crop(8)
    with pytest.raises(CacheCropError):
        chunked.crop(7)  # needs positions 4..6, evicted when the chunk ended


@given(
    pattern=st.sampled_from(["full", "sliding", "chunked"]),
    param=st.integers(1, 6),
    op=st.sampled_from(["reorder", "select", "repeat"]),
    static=st.booleans(),
    data=st.data(),
)
def test_batch_ops_then_continue_match_naive(pattern, param, op, static, data):
    n, batch = data.draw(st.integers(2, 16)), 3
    cut = data.draw(st.integers(1, n - 1))
    pads = [data.draw(st.integers(0, cut - 1)) for _ in range(batch)]
    g = torch.Generator().manual_seed(n * 7 + cut)
    q, k, v = (torch.randn(batch, 2, n, 2, generator=g) for _ in range(3))
    valid = torch.tensor(row_positions(pads, n)) >= 0
    layer = make_layer(pattern, param, 2, 2, batch, max_length=n if static else None)
    feed_blocks(layer, q, k, v, valid, [0, cut])
    if op == "reorder":
        index = data.draw(st.permutations(range(batch)))
        layer.reorder(torch.tensor(index))
    elif op == "select":
        index = data.draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=5))
        layer.select(torch.tensor(index))
    else:
        reps = data.draw(st.integers(1, 3))
        index = [r for r in range(batch) for _ in range(reps)]
        layer.repeat(reps)
    q, k, v, valid = q[index], k[index], v[index], valid[index]
    expected, _ = naive_attention(q, k, v, [pads[i] for i in index], pattern, param)
    got = feed_blocks(layer, q, k, v, valid, list(range(cut, n + 1)))
    assert_close_on_real(got, expected[:, :, cut:], valid[:, cut:])
