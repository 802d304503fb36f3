"""`compressed_kv` (hybridcache/cache/compressed/): what it holds is checked against a naive recompute written here
from the definition of the pooling (each entry is a gated softmax over its window of sources, with overlap over the
previous window's first series and its own second one), computed from the whole source sequence at once, whatever
the blocks it was fed in. Plus crop, batch operations, snapshot / restore, saved files, bytes and named refusals."""

import pytest
import torch

from hybridcache.cache import Cache, CacheConfigError, CacheCropError, CacheError, NativeLayer, register_cache_layer
from hybridcache.cache.compressed import CompressedKVLayer
from hybridcache.testing import ConformanceError, check_cache_type
from hybridcache.testing.compressed_kit import pool

R, D = 4, 3


def _cache(batch=2, overlap=True, dtype=torch.float64, rate=R):
    native = NativeLayer("compressed_kv", dict(compress_rate=rate, entry_dim=D, overlap=overlap, dtype=dtype))
    return Cache.build([native], batch)


def _sources(batch, n, overlap=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = 2 * D if overlap else D
    return torch.randn(batch, n, w, generator=g, dtype=torch.float64), torch.randn(batch, n, w, generator=g).double()


def _feed(cache, kv, gate, cuts):
    """Feed sources in blocks split at `cuts`, each pooled by the kit's mixer (through the layer's API)."""
    out = []
    for a, b in zip([0, *cuts], [*cuts, kv.shape[1]]):
        with cache.block(None, b - a):
            entries, last = pool(cache[0], kv[:, a:b], gate[:, a:b])
            out.append(cache[0].update(kv[:, a:b], gate[:, a:b], entries, last))
    return out[-1]


def naive_entries(kv, gate, rate, overlap):
    """The entries of the whole sequence by definition, window by window (no buffers, no blocks)."""
    b, n, w = kv.shape
    d = w // 2 if overlap else w
    entries = []
    for i in range(n // rate):
        win = slice(i * rate, (i + 1) * rate)
        if not overlap:
            z = gate[:, win].float().softmax(1).double()  # [B, r, D]
            entries.append((z * kv[:, win]).sum(1))
            continue
        vals, logits = [kv[:, win, d:]], [gate[:, win, d:].float()]
        if i > 0:
            prev = slice((i - 1) * rate, i * rate)
            vals.insert(0, kv[:, prev, :d])
            logits.insert(0, gate[:, prev, :d].float())
        z = torch.cat(logits, 1).softmax(1).double()
        entries.append((z * torch.cat(vals, 1)).sum(1))
    return torch.stack(entries, 1) if entries else kv.new_zeros(b, 0, d)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("cuts", [[], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 9], [4, 8, 12], [13]])
def test_entries_equal_a_naive_recompute_from_the_sources(overlap, cuts):
    kv, gate = _sources(2, 14, overlap, seed=len(cuts))
    cache = _cache(overlap=overlap)
    got = _feed(cache, kv, gate, cuts)
    want = naive_entries(kv, gate, R, overlap)
    assert got.shape == (2, 3, D) and torch.allclose(got, want, atol=1e-6)  # (float32 gate softmax)
    layer = cache[0]
    assert torch.equal(layer.entries, got)
    assert torch.equal(layer.buffer_kv, kv[:, 12:]) and torch.equal(layer.buffer_gate, gate[:, 12:])
    if overlap:  # the first series of the last closed window (columns 8..11)
        assert torch.equal(layer.overlap_kv, kv[:, 8:12, :D])
        assert torch.equal(layer.overlap_gate, gate[:, 8:12, :D].float())
    assert layer.nbytes() == layer.spec.min_nbytes(2, 14) == cache.plan.held_nbytes(2, 14)


def test_bytes_follow_the_spec():
    spec = _cache(overlap=True, dtype=torch.bfloat16)[0].spec
    # 9 tokens at rate 4: 2 entries of 3, 1 open source of 6 (kv + gate), the previous window 4 x 3 (bf16 + fp32)
    assert spec.min_nbytes(1, 9) == 2 * 3 * 2 + 1 * 6 * 2 * 2 + 4 * 3 * (2 + 4)
    assert _cache(overlap=False)[0].spec.min_nbytes(3, 9) == 3 * (2 * 3 * 8 + 1 * 3 * 2 * 8)


def test_crop_is_exact_within_the_open_window_and_refused_before():
    kv, gate = _sources(2, 14, seed=3)
    cache = _cache()
    _feed(cache, kv, gate, [5, 9])
    before = cache.snapshot()
    with pytest.raises(CacheCropError, match=r"crop back to column 12"):
        cache.crop(11)
    assert cache.columns == 14 and torch.equal(cache[0].buffer_kv, before.layers[0].tensors["buffer_kv"])
    cache.crop(13)
    more_kv, more_gate = _sources(2, 5, seed=4)
    _feed(cache, more_kv, more_gate, [2])
    fresh = _cache()
    _feed(fresh, torch.cat([kv[:, :13], more_kv], 1), torch.cat([gate[:, :13], more_gate], 1), [])
    assert torch.allclose(cache[0].entries, fresh[0].entries, atol=1e-12)
    assert torch.equal(cache[0].buffer_kv, fresh[0].buffer_kv)


def test_rows_move_with_reorder_select_and_repeat():
    kv, gate = _sources(3, 10, seed=5)
    cache = _cache(batch=3)
    _feed(cache, kv, gate, [6])
    entries, buffered, last = cache[0].entries.clone(), cache[0].buffer_kv.clone(), cache[0].overlap_gate.clone()
    cache.reorder(torch.tensor([2, 0, 1]))
    assert torch.equal(cache[0].entries, entries[[2, 0, 1]]) and torch.equal(cache[0].overlap_gate, last[[2, 0, 1]])
    cache.select(torch.tensor([1, 1]))
    assert torch.equal(cache[0].buffer_kv, buffered[[0, 0]])
    cache.repeat(2)
    assert cache[0].entries.shape == (4, 2, D) and torch.equal(cache[0].entries[3], entries[0])


def test_snapshot_restore_and_a_saved_file_are_bit_exact(tmp_path):
    kv, gate = _sources(2, 11, seed=6)
    cache = _cache()
    _feed(cache, kv, gate, [4, 7])
    snap = cache.snapshot()
    _feed(cache, *_sources(2, 3, seed=7), [])
    cache.restore(snap)
    assert torch.equal(cache[0].entries, snap.layers[0].tensors["entries"]) and cache.columns == 11
    model = _Owner()
    cache.save(tmp_path / "c.safetensors", model)
    loaded = Cache.load(tmp_path / "c.safetensors", model)
    for name, t in cache[0]._state_tensors().items():
        assert torch.equal(getattr(loaded[0], name), t), name
    assert loaded.columns == 11


class _Owner(torch.nn.Linear):
    """The model a saved cache belongs to: what loading asks of it (its native layers, a check of the cache)."""

    def __init__(self):
        super().__init__(2, 2)

    def native_layers(self):
        return [NativeLayer("compressed_kv", dict(compress_rate=R, entry_dim=D, overlap=True, dtype=torch.float64))]

    def check_cache(self, cache, batch_size):
        assert cache.batch_size == batch_size


def test_a_snapshot_whose_entries_do_not_make_its_columns_is_refused():
    kv, gate = _sources(1, 9, seed=8)
    cache = _cache(batch=1)
    _feed(cache, kv, gate, [])
    snap = cache.snapshot()
    bad = snap.layers[0].tensors
    bad["buffer_kv"] = bad["buffer_kv"][:, :0]  # 2 entries and no open source: 8 columns, not 9
    bad["buffer_gate"] = bad["buffer_gate"][:, :0]
    with pytest.raises(CacheError, match="do not make 9 columns"):
        cache.restore(snap)
    assert cache[0].buffer_kv.shape[1] == 1


def test_bad_feeds_are_named_errors_that_change_nothing():
    kv, gate = _sources(2, 6, seed=9)
    cache = _cache()
    _feed(cache, kv, gate, [])
    layer, before = cache[0], cache.snapshot()
    entries, last = pool(layer, kv[:, :3], gate[:, :3])  # the 3 sources close one window (2 held + 3 = 5)
    for args, match in (
        ((kv[:, :3, :5], gate[:, :3, :5], entries, last), "must be"),
        ((kv[:, :3].float(), gate[:, :3].float(), entries, last), "the layer holds"),
        ((kv[:, :3], gate[:, :3], entries[:, :0], last), "closes 1 window"),
        ((kv[:, :3], gate[:, :3], entries, None), "last_window must be"),
        ((kv[:, :3], gate[:, :3], entries, (last[0], last[1].double())), "last_window gate"),
    ):
        with pytest.raises(CacheError, match=match):
            with cache.block(None, 3):
                layer.update(*args)
        assert cache.columns == 6 and torch.equal(layer.buffer_kv, before.layers[0].tensors["buffer_kv"])
    with pytest.raises(CacheError, match="keeps no previous window"):
        _cache(overlap=False)[0].previous_window()


def test_spec_values_and_configs_are_checked():
    with pytest.raises(CacheConfigError, match="compress_rate"):
        _cache(rate=0)
    with pytest.raises(CacheConfigError, match="no recurrent layer of this model takes 'rollback'"):
        Cache.build(
            [NativeLayer("compressed_kv", dict(compress_rate=2, entry_dim=2))], 1, {"recurrent": {"rollback": 2}}
        )


def test_the_kit_catches_a_compressor_that_forgets_its_previous_window():
    @register_cache_layer("forgetful_compressed_test")
    class Forgetful(CompressedKVLayer):
        def previous_window(self):
            return None  # a block then pools its first window without the previous one's first series

    with pytest.raises(ConformanceError, match="fed in blocks"):
        check_cache_type("forgetful_compressed_test", cases=8)
