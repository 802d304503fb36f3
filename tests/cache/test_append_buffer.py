"""Dynamic dense attention layers append into spare slots in place (hybridcache/cache/storage/append_buffer.py)."""

import pytest
import torch

from hybridcache.cache import Cache, NativeLayer
from hybridcache.cache.storage.append_buffer import spare_slots


def _cache(kind, **params):
    return Cache.build([NativeLayer(kind, {"num_kv_heads": 2, "head_dim": 4, **params})], batch_size=2)


def _feed(cache, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    with cache.block(None, tokens):
        k, v = (torch.randn(2, 2, tokens, 4, generator=g) for _ in range(2))
        cache[0].update(k, v)
    return k, v


@pytest.mark.parametrize("kind, params", [("full", {}), ("sliding", {"window": 24}), ("chunked", {"chunk_size": 20})])
def test_decode_steps_write_in_place_and_hold_only_what_is_needed(kind, params):
    cache = _cache(kind, **params)
    layer = cache[0]
    history_k, buffers, peak = [], set(), 0
    _feed(cache, 5, seed=0)
    for step in range(300):
        k, _ = _feed(cache, 1, seed=step + 1)
        history_k.append(k)
        buffers.add(layer.storage.append_buffers.buffers["keys_data"].untyped_storage().data_ptr())
        held = layer.key_pos.shape[1]
        peak = max(peak, held)
        assert layer.nbytes() == layer.min_nbytes()  # the spare slots are not held tokens
        spare = layer.spare_nbytes() // (2 * 2 * 2 * 4 * 4 + 2 * 8)  # slots (keys + values [2, 2, 4] + key_pos)
        assert 0 <= held + spare <= peak + spare_slots(peak) + 1  # capacity: the most held, plus spare
        if held:  # (a chunk that just ended holds nothing)
            torch.testing.assert_close(layer.keys[:, :, -1:], k)  # the newest key is where it belongs
    # amortized: new buffers only when the spare slots ran out (at most one per ~held/4 steps, >= 16)
    assert len(buffers) <= 300 // 12


def test_an_aborted_block_leaves_what_the_layer_holds():
    cache = _cache("full")
    _feed(cache, 3, seed=0)
    before = (cache[0].keys.clone(), cache[0].key_pos.clone())
    with pytest.raises(RuntimeError):
        with cache.block(None, 1):
            cache[0].update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))  # written into a spare slot
            raise RuntimeError("the model failed after the update")
    assert torch.equal(cache[0].keys, before[0]) and torch.equal(cache[0].key_pos, before[1])
    k, _ = _feed(cache, 1, seed=9)  # the next block takes the same spare slot
    assert torch.equal(cache[0].keys[:, :, :3], before[0]) and torch.equal(cache[0].keys[:, :, 3:], k)


@pytest.mark.parametrize(("kind", "params"), [("full", {}), ("sliding", {"window": 4}), ("chunked", {"chunk_size": 3})])
def test_a_reserved_decode_slot_written_by_the_caller_is_update(kind, params):
    """AttentionCacheLayer.decode_slot (a kernel writes the token's keys and values itself): writing the slot it
    names gives the view and, after the commit, the layer that update(k, v) gives, step after step, past spare
    slots running out and windows / chunks ending; an aborted block leaves nothing behind."""
    a, b = _cache(kind, **params), _cache(kind, **params)
    valid = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)  # left padding in the prompt
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 3, 4, generator=g) for _ in range(2))
    for cache in (a, b):
        with cache.block(valid, 3):
            cache[0].update(k, v)
    g = torch.Generator().manual_seed(1)
    for step in range(40):
        k, v = torch.randn(2, 2, 1, 4, generator=g), torch.randn(2, 2, 1, 4, generator=g)
        with a.block(None, 1):
            want = a[0].update(k, v)
        if step % 7 == 3:  # reserved, then the block fails before the slot is written
            with pytest.raises(RuntimeError), b.block(None, 1):
                assert b[0].decode_slot() is not None
                raise RuntimeError("failed")
        with b.block(None, 1):
            view, slot = b[0].decode_slot()
            view.keys.narrow(2, slot, 1).copy_(k)
            view.values.narrow(2, slot, 1).copy_(v)
            for name in ("keys", "values", "key_positions", "query_positions"):
                assert torch.equal(getattr(view, name), getattr(want, name)), name
        layer_a, layer_b = a[0], b[0]
        assert torch.equal(layer_a.keys, layer_b.keys) and torch.equal(layer_a.values, layer_b.values)
        assert torch.equal(layer_a.key_pos, layer_b.key_pos)
