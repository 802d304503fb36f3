"""Memory: bounded storage for sliding/chunked, held bytes vs the theoretical minimum from the specs."""

import pytest
import torch

from hybridcache.cache import Cache, NativeLayer
from hybridcache.tools.report import render_memory
from tests.cache.helpers import feed, hybrid_cache

H, D = 2, 4
TOKEN_BYTES = 2 * H * D * 4  # key + value, float32


@pytest.mark.parametrize("pattern,param", [("sliding", 16), ("chunked", 16)])
def test_dynamic_storage_stops_growing(pattern, param):
    key = "window" if pattern == "sliding" else "chunk_size"
    cache = Cache.build([NativeLayer(pattern, {"num_kv_heads": H, "head_dim": D, key: param})], batch_size=2)
    layer = cache[0]
    k = torch.randn(2, H, 1, D)
    sizes = [layer.nbytes()]  # sizes[n]: bytes held after n updates
    for _ in range(10_000):
        with cache.block(None, 1):
            layer.update(k, k)
        sizes.append(layer.nbytes())
    if pattern == "sliding":  # after the first full window the size never changes
        assert set(sizes[param - 1 :]) == {2 * (param - 1) * TOKEN_BYTES}
    else:  # the current chunk only: 0 .. C-1 tokens, the same at the same phase of every chunk
        assert max(sizes) == 2 * (param - 1) * TOKEN_BYTES
        assert all(sizes[n] == 2 * (n % param) * TOKEN_BYTES for n in range(len(sizes)))
        assert sizes[10_000] == sizes[param]
    assert layer.seen.tolist() == [10_000, 10_000]


def test_held_equals_minimum_for_dynamic_layers_and_allocation_for_static():
    batch, tokens = 2, 100
    dynamic = hybrid_cache(batch=batch)
    feed(dynamic, tokens)
    for row in dynamic.memory_report():
        assert row["held"] == row["minimum"], row
    by_type = {r["type"]: r for r in dynamic.memory_report()}
    assert by_type["full"]["held"] == batch * tokens * TOKEN_BYTES  # by hand: every token
    assert by_type["sliding"]["held"] == batch * 3 * TOKEN_BYTES  # window 4 keeps 3
    assert by_type["chunked"]["held"] == batch * (100 % 3) * TOKEN_BYTES
    static = hybrid_cache(batch=batch, max_length=128)
    feed(static, tokens)
    rep = {r["type"]: r for r in static.memory_report()}
    assert rep["full (preallocated)"]["held"] == batch * 128 * TOKEN_BYTES
    assert rep["sliding (preallocated)"]["held"] == batch * 4 * TOKEN_BYTES  # ring of W slots
    assert rep["chunked (preallocated)"]["held"] == batch * 3 * TOKEN_BYTES  # ring of C slots
    assert static.plan.held_nbytes(batch, tokens) == static.nbytes()
    assert dynamic.plan.held_nbytes(batch, tokens) == dynamic.nbytes()


def test_memory_table_renders():
    cache = hybrid_cache(batch=1)
    feed(cache, 7)
    text = render_memory(cache)
    assert "sliding" in text and "held / minimum" in text
