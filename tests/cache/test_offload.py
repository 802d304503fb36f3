"""`storage: offload`: exact (bit for bit the dense cache) on every pattern and layout, parts parked in memory-mapped
files on CPU (pinned CPU memory on a GPU), next-layer prefetch learned from the feeding order, dense byte accounting."""

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import Cache, NativeLayer
from hybridcache.cache.storage.offload import OffloadTier
from hybridcache.checkpoints.tiny import tiny_checkpoint
from hybridcache.testing import check_cache_type

H, D = 2, 8


def mapped_files() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "hybridcache-offload-" in line]


@pytest.fixture(autouse=True)
def offload_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDCACHE_OFFLOAD_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    "pattern,params",
    [
        ("full", {}),
        ("sliding", {"window": 5}),
        ("chunked", {"chunk_size": 4}),
        ("sink", {"window": 4, "sinks": 2}),
        ("tova", {"budget": 6}),
    ],
)
def test_every_pattern_passes_the_kit(pattern, params):
    counts = check_cache_type(pattern, params={**params, "storage": "offload"}, cases=6)
    assert counts["split == one-shot"] >= 6 and counts["snapshot / restore"] > 0


@pytest.mark.parametrize("max_length", [None, 24])
def test_parts_live_in_unlinked_memory_mapped_files(offload_dir, max_length):
    cache = Cache.build(
        [NativeLayer("full", {"num_kv_heads": H, "head_dim": D})],
        2,
        {"attention": {"storage": "offload"}},
        max_length=max_length,
    )
    with cache.block(None, 5):
        cache[0].update(torch.randn(2, H, 5, D), torch.randn(2, H, 5, D))
    layer = cache[0]
    for t in (layer.keys_data, layer.values_data):
        name = t.untyped_storage().filename
        assert name is not None and name.startswith(str(offload_dir)) and "hybridcache-offload-" in name
    assert list(offload_dir.iterdir()) == []  # unlinked as soon as mapped: nothing left behind
    held = 2 * (max_length or 5) * 2 * H * D * 4
    assert cache.nbytes() == held == cache.plan.held_nbytes(2, 5)  # the dense bytes
    assert any(f"{offload_dir}/hybridcache-offload-" in line for line in mapped_files())


def test_preallocated_decode_writes_into_the_same_files():
    cache = Cache.build(
        [NativeLayer("sliding", {"num_kv_heads": H, "head_dim": D, "window": 4})],
        1,
        {"attention": {"storage": "offload"}},
        max_length=32,
    )
    with cache.block(None, 3):
        cache[0].update(torch.randn(1, H, 3, D), torch.randn(1, H, 3, D))
    before = cache[0].keys_data.untyped_storage().filename
    for _ in range(6):
        with cache.block(None, 1):
            cache[0].update(torch.randn(1, H, 1, D), torch.randn(1, H, 1, D))
    assert cache[0].keys_data.untyped_storage().filename == before  # ring written back in place


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import os

    os.environ.setdefault("HYBRIDCACHE_HOME", str(tmp_path_factory.mktemp("home")))
    return {f: hc.from_pretrained(tiny_checkpoint(f)) for f in ("gemma3", "jamba")}


@pytest.mark.parametrize("family", ["gemma3", "jamba"])
@pytest.mark.parametrize(
    "config", [{}, {"attention": {"type": "chunked", "chunk_size": 4}}, {"attention": {"type": "sliding", "window": 5}}]
)
@pytest.mark.parametrize("max_length", [None, 40])
def test_generation_is_bit_exact_with_dense_storage(models, family, config, max_length):
    model = models[family]
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, :3] = 0

    def run(storage):
        cfg = {**config, "attention": {**config.get("attention", {}), "storage": storage}}
        cache = model.make_cache(2, cfg, max_length=max_length)
        return hc.generate(model, ids, attention_mask=mask, max_new_tokens=7, cache=cache, prefill_chunk_size=4)

    dense, offload = run("dense"), run("offload")
    assert torch.equal(dense.sequences, offload.sequences) and torch.equal(dense.logits, offload.logits)
    assert dense.cache.nbytes() == offload.cache.nbytes()
    # batch operations on the offloaded cache: beam-style reorder, then one more step, still equal
    for out in (dense, offload):
        out.cache.reorder([1, 0])
    more = torch.flip(dense.sequences, [0])
    full_mask = torch.flip(torch.cat([mask, torch.ones(2, 7, dtype=torch.long)], 1), [0])
    a = hc.generate(model, more, attention_mask=full_mask, max_new_tokens=2, cache=dense.cache)
    b = hc.generate(model, more, attention_mask=full_mask, max_new_tokens=2, cache=offload.cache)
    assert torch.equal(a.logits, b.logits)


def test_next_layer_is_learned_and_prefetched(models):
    model = models["gemma3"]
    cache = model.make_cache(1, {"attention": {"storage": "offload"}})
    tiers = [layer.storage.tier for layer in cache.layers]
    assert all(isinstance(t, OffloadTier) for t in tiers) and len(tiers) > 1
    out = hc.generate(model, torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=4, cache=cache)  # 4 blocks
    for a, b in zip(tiers, tiers[1:] + tiers[:1]):  # each layer links to the one fed after it (the last to the first)
        assert a.next() is b
    # per block a layer is fetched for its update and for its commit (8 fetches each); once the order is known
    # (after the first block's updates), every fetch is served by the copy its predecessor prefetched
    assert [t.prefetch_hits for t in tiers] == [6] + [7] * (len(tiers) - 1)
    assert tiers[0].prefetched is not None and all(t.prefetched is None for t in tiers[1:])  # ready for block 5
    assert out.sequences.shape == (1, 9)


def test_between_blocks_no_layer_holds_a_resident_copy(models):
    model = models["gemma3"]
    out = hc.generate(
        model, torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=3, cache_config={"attention": {"storage": "offload"}}
    )
    for layer in out.cache.layers:
        for attr in layer.storage.inner.parts:
            assert getattr(layer, attr) is layer.storage.tier.parked[attr]
            assert getattr(layer, attr).untyped_storage().filename is not None


def test_a_stale_prefetch_is_dropped_when_the_layer_changes(models):
    model = models["gemma3"]
    ids = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(2))
    dense = hc.generate(model, ids, max_new_tokens=2)
    off = hc.generate(model, ids, max_new_tokens=2, cache_config={"attention": {"storage": "offload"}})
    snap = off.cache.snapshot()
    hc.generate(model, torch.cat([off.sequences, ids[:, :3]], 1), max_new_tokens=2, cache=off.cache)
    assert off.cache.layers[0].storage.tier.prefetched is not None  # prefetched the longer state
    off.cache.restore(snap)  # parks every layer again: copies of the longer state are gone
    assert all(layer.storage.tier.prefetched is None for layer in off.cache.layers)
    seq = torch.cat([dense.sequences, torch.full((2, 2), 7)], 1)
    a = hc.generate(model, seq, max_new_tokens=3, cache=dense.cache)
    b = hc.generate(model, seq, max_new_tokens=3, cache=off.cache)
    assert torch.equal(a.logits, b.logits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (parks in pinned CPU memory there)")
def test_on_a_gpu_parts_are_pinned_cpu_memory_and_exact(models):
    model = hc.from_pretrained(tiny_checkpoint("gemma3"), device="cuda")
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(3)).cuda()
    dense = hc.generate(model, ids, max_new_tokens=5)
    off = hc.generate(model, ids, max_new_tokens=5, cache_config={"attention": {"storage": "offload"}})
    assert torch.equal(dense.sequences, off.sequences) and torch.equal(dense.logits, off.logits)
    layer = off.cache.layers[0]
    assert layer.keys_data.device.type == "cpu" and layer.keys_data.is_pinned()


def test_save_and_load_round_trip_parks_the_loaded_parts(models, tmp_path):
    model, config = models["gemma3"], {"attention": {"storage": "offload"}}
    out = hc.generate(model, torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), max_new_tokens=4, cache_config=config)
    out.cache.save(tmp_path / "off", model=model)
    loaded = Cache.load(tmp_path / "off", model, cache_config=config)
    assert all(layer.keys_data.untyped_storage().filename for layer in loaded.layers)
    seq = torch.cat([out.sequences, torch.tensor([[3, 4]])], 1)
    a = hc.generate(model, seq, max_new_tokens=3, cache=out.cache)
    b = hc.generate(model, seq, max_new_tokens=3, cache=loaded)
    assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("max_length", [None, 16])
def test_a_failed_block_leaves_every_offloaded_layer_unchanged(max_length):
    from hybridcache.cache import CacheError
    from tests.cache.helpers import state_equal

    native = [NativeLayer("full", {"num_kv_heads": H, "head_dim": D})] * 2
    caches = [
        Cache.build(native, 1, {"attention": {"storage": s}}, max_length=max_length) for s in ("offload", "dense")
    ]
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(2, 1, H, n, D, generator=g) for n in (3, 1, 1)]
    for kv in steps[:2]:
        for cache in caches:
            with cache.block(None, kv.shape[3]):
                for layer in cache.layers:
                    layer.update(kv[0], kv[1])
    offload = caches[0]
    before = offload.snapshot()
    with pytest.raises(CacheError), offload.block(None, 1):  # a one-token decode block that fails in layer 1
        offload[0].update(steps[2][0], steps[2][1])
        offload[1].update(steps[2][0][..., :-1], steps[2][1][..., :-1])
    assert state_equal(offload.snapshot(), before)
    for cache in caches:  # and it continues exactly like the dense cache
        with cache.block(None, 1):
            views = [layer.update(steps[2][0], steps[2][1]) for layer in cache.layers]
        cache.views = views
    for a, b in zip(*(c.views for c in caches)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
