"""`spare` on sliding / chunked / sink attention: r tokens held beyond what the next query sees, so a crop of up to r
tokens is exact (speculative decoding's rollback by crop instead of snapshot + recompute).

Oracle: a fresh cache fed only the kept prefix (a crop must leave exactly what it would have); the control: the same
crop without `spare` is refused (the tokens it needs were evicted)."""

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import CacheError
from hybridcache.cache.attention.sink import SinkSpec
from hybridcache.cache.attention.specs import ChunkedSpec, SlidingSpec
from hybridcache.checkpoints.tiny import tiny_checkpoint

CONFIGS = {
    "sliding": {"attention": {"type": "sliding", "window": 5}},
    "chunked": {"attention": {"type": "chunked", "chunk_size": 4}},
    "sink": {"attention": {"type": "sink", "window": 4, "sinks": 2}},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hc.from_pretrained(tiny_checkpoint("gemma3"))


def with_spare(config, r):
    return {"attention": {**config["attention"], "spare": r}}


@pytest.mark.parametrize("pattern", sorted(CONFIGS))
@pytest.mark.parametrize("split", [1, 3])
def test_crop_within_spare_equals_a_cache_that_never_saw_the_tokens(model, pattern, split):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 23), generator=g)
    r = 3
    config = with_spare(CONFIGS[pattern], r)
    for n in range(r + 2, 20):
        for back in range(1, r + 1):
            cache = model.make_cache(2, config)
            for i in range(0, n, split):  # fed in blocks of `split`, then rolled back
                model.feed_block(ids[:, i : min(n, i + split)], cache, None)
            cache.crop(n - back)
            got = model.feed_block(ids[:, n - back : n - back + 2], cache, None)
            fresh = model.make_cache(2, CONFIGS[pattern])
            model.feed_block(ids[:, : n - back], fresh, None)
            want = model.feed_block(ids[:, n - back : n - back + 2], fresh, None)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pattern", sorted(CONFIGS))
def test_without_spare_the_same_crop_is_refused(model, pattern):
    ids = torch.randint(3, 300, (1, 14), generator=torch.Generator().manual_seed(1))
    cache = model.make_cache(1, CONFIGS[pattern])
    for i in range(14):
        model.feed_block(ids[:, i : i + 1], cache, None)
    with pytest.raises(CacheError, match="cannot crop"):
        cache.crop(11)


@pytest.mark.parametrize(
    ("spec", "seen", "held"),
    [
        (SlidingSpec(num_kv_heads=1, head_dim=4, window=5, spare=3), 20, 4 + 3),
        (SlidingSpec(num_kv_heads=1, head_dim=4, window=5, spare=3), 2, 2),
        (ChunkedSpec(num_kv_heads=1, head_dim=4, chunk_size=4, spare=2), 9, 9 - 4),  # positions 4..8 (q=7 is chunk 4)
        (ChunkedSpec(num_kv_heads=1, head_dim=4, chunk_size=4, spare=2), 11, 11 - 8),
        (SinkSpec(num_kv_heads=1, head_dim=4, window=4, sinks=2, spare=1), 30, 2 + 3 + 1),
    ],
)
def test_held_tokens_counts_what_keeps_holds(spec, seen, held):
    """The bytes accounting (held_tokens) equals the positions `keeps` holds, counted here by hand."""
    assert spec.held_tokens(seen) == held
    kept = spec.keeps(torch.tensor(seen), torch.arange(seen))
    assert int(kept.sum()) == held


def test_bad_spare_is_a_named_error():
    for kw in (
        {"spare": -1},
        {"spare": 10**6},
        {"spare": 1.5},
        {"spare": True},
        {"spare": 2, "max_length": 16},
        {"spare": 1, "residual": 4, "storage": "int8"},
    ):
        with pytest.raises(CacheError, match="spare"):
            SlidingSpec(num_kv_heads=1, head_dim=4, window=5, **kw)


def test_speculative_rolls_back_sliding_layers_by_crop(model):
    """gemma3's native sliding layers get `spare` in speculative decoding: rollback by crop, output unchanged."""
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(2))
    plain = hc.generate(model, ids, max_new_tokens=10)
    spec = hc.generate(model, ids, max_new_tokens=10, draft_model=hc.EarlyExitDraft(model, 1), num_draft_tokens=3)
    assert torch.equal(spec.sequences, plain.sequences)
    assert spec.stats["rollback"] == {"target": "crop", "draft": "crop"}


@pytest.mark.parametrize(
    "user",
    [
        None,
        {"layers": {0: {"attention": {"window": 3}}}},  # a whole-layer entry naming the member
        {"layers": {"0.attention": {"window": 3}}},  # the member's own address
        {"layers": {1: {"window": 3}}},  # another layer's entry is kept as it is
    ],
)
def test_with_rollback_merges_spare_into_the_users_own_entries(user):
    """Speculative decoding's cache config: spare = k on every layer whose type takes it (a group member too),
    merged into the user's entry for that layer, never replacing it; full attention left alone."""
    from types import SimpleNamespace

    from hybridcache.cache.core.plan import NativeGroup, NativeLayer, resolve_plan
    from hybridcache.generation.sources.speculative import with_rollback

    shape = {"num_kv_heads": 1, "head_dim": 4}
    native = [
        NativeGroup({"attention": NativeLayer("sliding", {**shape, "window": 5}), "other": NativeLayer("full", shape)}),
        NativeLayer("sliding", {**shape, "window": 5}),
    ]
    config = with_rollback(SimpleNamespace(native_layers=lambda: native), user, 4)
    plan = {p.address: p for p in resolve_plan(native, config).layers}
    assert plan["0.attention"].spec.spare == 4 and plan["1"].spec.spare == 4
    assert plan["0.other"].type == "full"
    user_layers = (user or {}).get("layers", {})
    want0 = 3 if any(str(k).startswith("0") for k in user_layers) else 5
    want1 = 3 if 1 in user_layers else 5
    assert plan["0.attention"].spec.window == want0 and plan["1"].spec.window == want1
