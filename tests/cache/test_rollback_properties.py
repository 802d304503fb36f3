"""Rollback as a property: random recurrent cache types, checkpoint counts, left padding, block sizes and crops.

Every recurrent state after column c is filled with c (states written by hand, as a mixer would hand them over), so
the oracle is exact: `crop(n)` either gives back the state after column n (and the sequence state of the first n
columns) or raises `CacheCropError` leaving every layer unchanged, and it must succeed for every n within the last
`rollback` columns that no earlier crop discarded.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridcache.cache import Cache, CacheCropError
from tests.cache.helpers import NATIVE, state_equal

RECURRENT = ["mamba", "mamba2", "rglru", "conv", "gated_delta", "linear_attention"]
NATIVE_EXTRA = {
    "gated_delta": ("gated_delta", dict(num_k_heads=1, num_v_heads=2, head_k_dim=2, head_v_dim=3, conv_kernel=3)),
    "linear_attention": ("linear_attention", dict(num_heads=2, key_dim=2, value_dim=3)),
}


def native(name):
    from hybridcache.cache import NativeLayer

    if name in NATIVE:
        return NATIVE[name]
    kind, params = NATIVE_EXTRA[name]
    return NativeLayer(kind, params)


def states_at(layer, column, batch):
    """The synthetic state after `column`: every value equals the column."""
    return {
        n: torch.full((batch, *shape), float(column), dtype=dtype)
        for n, (shape, dtype) in layer.spec.state_shapes().items()
    }


def feed(cache, tokens, valid, g):
    """One block: attention layers get random keys, recurrent ones the state after its last column and a trail."""
    start, batch = cache.columns, cache.batch_size
    with cache.block(valid, tokens):
        for layer in cache.layers:
            if layer.kind == "attention":
                s = layer.spec
                k = torch.randn(batch, s.num_kv_heads, tokens, s.head_dim, generator=g)
                layer.update(k, torch.randn(k.shape, generator=g))
                continue
            m = layer.trail_length(tokens)
            trail = None
            if m:
                cols = range(start + tokens - m, start + tokens)
                trail = {
                    n: torch.stack([states_at(layer, c, batch)[n] for c in cols], 1) for n in layer.spec.state_shapes()
                }
            layer.update(trail=trail, **states_at(layer, start + tokens, batch))


@given(
    types=st.lists(st.sampled_from(RECURRENT), min_size=1, max_size=3),
    with_attention=st.booleans(),
    k=st.integers(1, 6),
    batch=st.integers(1, 3),
    data=st.data(),
)
def test_crop_is_exact_within_the_rollback_or_refused_without_change(types, with_attention, k, batch, data):
    natives = [native(t) for t in types] + ([NATIVE["full"]] if with_attention else [])
    cache = Cache.build(natives, batch, {"recurrent": {"rollback": k}})
    g = torch.Generator().manual_seed(k * 31 + batch)
    first = data.draw(st.integers(1, 6))
    pads = [data.draw(st.integers(0, first - 1)) for _ in range(batch)]
    mask = torch.ones(batch, first, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    feed(cache, first, mask, g)
    real = mask.bool()  # [B, columns]: which columns of each row are real tokens
    floor = 0  # below this column, an earlier crop may have discarded the trail
    for _ in range(data.draw(st.integers(1, 8))):
        if data.draw(st.booleans()):
            tokens = data.draw(st.integers(1, 5))
            feed(cache, tokens, None, g)
            real = torch.cat([real, torch.ones(batch, tokens, dtype=torch.bool)], 1)
            continue
        columns = cache.columns
        n = data.draw(st.integers(0, columns))
        before = cache.snapshot()
        try:
            cache.crop(n)
        except CacheCropError:
            assert n != columns and not (n >= columns - k and n >= floor), f"crop({n}) of {columns} refused, k={k}"
            assert state_equal(cache.snapshot(), before)
            continue
        assert cache.columns == n and torch.equal(cache.seen, real[:, :n].sum(1))
        for layer in cache.layers:
            if layer.kind == "recurrent":
                for name, t in layer.states.items():
                    assert torch.equal(t, states_at(layer, n, batch)[name]), (layer.type_name, name, n)
        floor = max(floor, columns - k) if n < columns else floor
        real = real[:, :n]


def test_the_property_above_sees_every_recurrent_type():
    cache = Cache.build([native(t) for t in RECURRENT], 1, {"recurrent": {"rollback": 2}})
    assert [layer.type_name for layer in cache.layers] == RECURRENT
    feed(cache, 4, None, torch.Generator().manual_seed(0))
    cache.crop(2)
    with pytest.raises(CacheCropError):
        cache.crop(0)
