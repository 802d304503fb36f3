"""Recurrent cache layers: shapes, dtypes, updates, reset, batch operations, snapshot/restore."""

import pytest
import torch

from hybridcache.cache import Cache, CacheCropError
from tests.cache.helpers import NATIVE, feed, hybrid_cache, state_equal

SHAPES = {  # by hand from the specs in helpers.NATIVE (conv keeps K-1 inputs)
    "mamba": {"conv": (6, 3), "ssm": (6, 3)},
    "mamba2": {"conv": (2 * 3 + 2 * 1 * 4, 3), "ssm": (2, 3, 4)},
    "rglru": {"conv": (5, 3), "lru": (5,)},
    "conv": {"conv": (5, 2)},
}


@pytest.mark.parametrize("kind", list(SHAPES))
def test_state_shapes_and_dtypes(kind):
    cache = Cache.build([NATIVE[kind]], batch_size=3)
    layer = cache[0]
    assert layer.kind == "recurrent"
    assert {n: tuple(t.shape[1:]) for n, t in layer.states.items()} == SHAPES[kind]
    for t in layer.states.values():
        assert t.shape[0] == 3
        assert t.dtype == torch.float32 and not t.any()
    assert (
        layer.nbytes()
        == layer.spec.min_nbytes(3, 100)
        == 3 * sum(torch.Size(s).numel() * 4 for s in SHAPES[kind].values())
    )


def test_state_dtype_is_float32_by_default_and_tunable():
    half = Cache.build([NATIVE["rglru"]], 1, {"recurrent": {"state_dtype": torch.float64}})
    assert half[0].states["lru"].dtype == torch.float64
    bf16 = Cache.build([type(NATIVE["mamba"])("mamba", {**NATIVE["mamba"].params, "dtype": torch.bfloat16})], 1)
    assert bf16[0].states["conv"].dtype == torch.bfloat16 and bf16[0].states["ssm"].dtype == torch.float32


def test_update_counts_real_tokens_and_copies_states():
    cache = Cache.build([NATIVE["mamba"]], 2)
    layer = cache[0]
    new = {n: torch.randn(t.shape) for n, t in layer.states.items()}
    with cache.block(torch.tensor([[0, 1, 1], [1, 1, 1]])):
        layer.update(**new)
        assert not torch.equal(layer.states["ssm"], new["ssm"])  # staged until the block commits
    assert layer.seen.tolist() == [2, 3] and layer.columns == 3
    for n in new:
        assert torch.equal(layer.states[n], new[n])
    cache.reset()
    assert layer.seen.tolist() == [0, 0] and layer.columns == 0 and not layer.states["ssm"].any()


def test_batch_operations_move_rows():
    cache = hybrid_cache(batch=3)
    feed(cache, 5, valid=torch.tensor([[0, 0, 1, 1, 1], [1] * 5, [0, 1, 1, 1, 1]]))
    before = cache.snapshot()
    cache.reorder([2, 0, 1])
    assert cache.seen.tolist() == before.seen[[2, 0, 1]].tolist()
    for layer, snap in zip(cache, before.layers):
        for name in layer._batch_tensors:
            assert torch.equal(getattr(layer, name), snap.tensors[name][[2, 0, 1]]), (layer.type_name, name)
    cache.restore(before)
    cache.select([1])
    assert cache.batch_size == 1 and cache.seen.tolist() == [5]
    for layer, snap in zip(cache, before.layers):
        for name in layer._batch_tensors:
            assert torch.equal(getattr(layer, name), snap.tensors[name][[1]])
    cache.restore(before)
    cache.repeat(2)
    assert cache.batch_size == 6 and cache.seen.tolist() == [3, 3, 5, 5, 4, 4]
    for layer, snap in zip(cache, before.layers):
        for name in layer._batch_tensors:
            assert torch.equal(getattr(layer, name), snap.tensors[name].repeat_interleave(2, 0))


@pytest.mark.parametrize("max_length", [None, 16])
def test_snapshot_restore_is_bit_exact(max_length):
    cache = hybrid_cache(batch=2, max_length=max_length)
    feed(cache, 4, seed=1)
    snap = cache.snapshot()
    feed(cache, 1, seed=2)
    feed(cache, 3, seed=3)
    after = cache.snapshot()
    assert not state_equal(snap, after)
    cache.restore(snap)
    assert state_equal(cache.snapshot(), snap)
    feed(cache, 1, seed=2)  # the same continuation gives the same state again
    feed(cache, 3, seed=3)
    assert state_equal(cache.snapshot(), after)


def test_snapshot_is_a_copy():
    cache = hybrid_cache(batch=1)
    snap = cache.snapshot()
    feed(cache, 2)
    assert all(not t.any() for t in snap.layers[3].tensors.values() if t.is_floating_point())


def test_recurrent_crop_says_how_to_roll_back():
    cache = Cache.build([NATIVE["mamba2"]], 1)
    feed(cache, 4)
    cache.crop(4)  # cropping to the current length is a no-op
    with pytest.raises(CacheCropError, match=r"snapshot\(\).*restore"):
        cache.crop(2)
    assert cache.columns == 4
