"""The residual window (`residual: R` next to a quantized storage): the last R tokens of each row are read
bit-exactly, older ones from their quantized copy; exact while everything fits; composes with every pattern and
layout; bytes held by hand; bad configs."""

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import Cache, CacheError, NativeLayer, get_codec, resolve_plan
from hybridcache.checkpoints.tiny import tiny_checkpoint
from hybridcache.testing import check_cache_type

H, D = 2, 8
PATTERNS = [
    ("full", {}),
    ("sliding", {"window": 6}),
    ("chunked", {"chunk_size": 5}),
    ("sink", {"window": 4, "sinks": 2}),
]


def build(pattern, params, storage="int4", residual=4, batch=2, max_length=None, dtype=torch.float64):
    native = NativeLayer("full", {"num_kv_heads": H, "head_dim": D, "dtype": dtype})
    entry = {"type": pattern, **params, "storage": storage, **({"residual": residual} if residual is not None else {})}
    return Cache.build([native], batch, {"attention": entry}, max_length=max_length)


def stream(cache, k, v, mask, bounds):
    """Feed blocks; per block the view's keys/values and key positions."""
    views = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        m = mask[:, a:b]
        with cache.block(None if bool(m.all()) else m, b - a):
            view = cache[0].update(k[:, :, a:b], v[:, :, a:b])
        views.append((view.keys.clone(), view.values.clone(), view.key_positions.clone()))
    return views


def data(batch, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, H, n, D, generator=g, dtype=torch.float64) for _ in range(2))


SPLITS = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [0, 5, 6, 7, 12], [0, 12]]


@pytest.mark.parametrize("pattern,params", PATTERNS)
@pytest.mark.parametrize("max_length", [None, 16])
@pytest.mark.parametrize("bounds", SPLITS)
def test_bit_exact_while_every_token_fits_in_the_window(pattern, params, max_length, bounds):
    if pattern == "sink" and max_length:
        pytest.skip("preallocated: a ring of min(R, sinks + W) slots holds the last positions, not the sinks")
    k, v = data(2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False  # row 1 left-padded
    quantized = stream(build(pattern, params, residual=12, max_length=max_length), k, v, mask, bounds)
    dense = stream(build(pattern, params, storage="dense", residual=None, max_length=max_length), k, v, mask, bounds)
    for (qk, qv, qp), (dk, dv, dp) in zip(quantized, dense):
        assert torch.equal(qp, dp)
        seen = qp >= 0
        assert torch.equal(qk.transpose(1, 2)[seen], dk.transpose(1, 2)[seen])
        assert torch.equal(qv.transpose(1, 2)[seen], dv.transpose(1, 2)[seen])


@pytest.mark.parametrize("storage", ["int4", "int8"])
@pytest.mark.parametrize("max_length", [None, 32])
@pytest.mark.parametrize("bounds", [list(range(21)), [0, 7, 8, 15, 20], [0, 20]])
def test_last_r_tokens_exact_older_ones_quantized(storage, max_length, bounds):
    r = 5
    k, v = data(2, 20, seed=1)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :4] = False
    cache = build("full", {}, storage=storage, residual=r, max_length=max_length)
    codec = get_codec(storage)
    roundtrip = {name: codec.decode(codec.encode(x), torch.float64) for name, x in (("k", k), ("v", v))}
    for a, b in zip(bounds[:-1], bounds[1:]):
        m = mask[:, a:b]
        with cache.block(None if bool(m.all()) else m, b - a):
            cache[0].update(k[:, :, a:b], v[:, :, a:b])
        keys, values = cache[0].read()
        pos = cache[0].key_positions()
        seen = cache.seen
        for row in range(2):
            pad = 4 if row else 0
            for slot in range(pos.shape[1]):
                p = int(pos[row, slot])
                if p < 0:
                    continue
                column = p + pad
                if p >= int(seen[row]) - r:  # inside the window: the very values that were written
                    assert torch.equal(keys[row, :, slot], k[row, :, column])
                    assert torch.equal(values[row, :, slot], v[row, :, column])
                else:  # older: exactly the quantized copy
                    assert torch.equal(keys[row, :, slot], roundtrip["k"][row, :, column])
                    assert torch.equal(values[row, :, slot], roundtrip["v"][row, :, column])
                    assert not torch.equal(keys[row, :, slot], k[row, :, column])


GEMMA = {"num_kv_heads": 1, "head_dim": 256}
INT4, DENSE = 2 * (128 + 8 * 4), 2 * 256 * 4  # bytes per token: int4 (group 32) and float32


@pytest.mark.parametrize(
    "native,tokens,quantized,window",
    [
        (NativeLayer("full", GEMMA), 100, 100, 32),  # every token in int4, the last 32 dense too
        (NativeLayer("full", GEMMA), 20, 20, 20),  # everything inside the window
        (NativeLayer("sliding", {**GEMMA, "window": 16}), 100, 15, 15),  # the pattern keeps W-1 = 15: all in the window
        (NativeLayer("chunked", {**GEMMA, "chunk_size": 64}), 100, 36, 32),
        (NativeLayer("chunked", {**GEMMA, "chunk_size": 64}), 128, 0, 0),  # at a chunk boundary nothing is held
    ],
)
def test_dynamic_bytes_by_hand(native, tokens, quantized, window):
    cache = Cache.build([native], 1, {"attention": {"storage": "int4", "residual": 32}})
    g = torch.Generator().manual_seed(0)
    for n in (tokens // 2, 1, tokens - tokens // 2 - 1):
        with cache.block(None, n):
            cache[0].update(*(torch.randn(1, 1, n, 256, generator=g) for _ in range(2)))
    assert cache.nbytes() == quantized * INT4 + window * DENSE == cache.plan.held_nbytes(1, tokens)
    assert cache[0].res_pos.shape[1] == window


@pytest.mark.parametrize(
    "native,slots,ring",
    [
        (NativeLayer("full", GEMMA), 128, 32),
        (NativeLayer("sliding", {**GEMMA, "window": 16}), 16, 16),  # ring of min(R, W) slots
        (NativeLayer("chunked", {**GEMMA, "chunk_size": 64}), 64, 32),
    ],
)
def test_preallocated_bytes_by_hand(native, slots, ring):
    cache = Cache.build([native], 2, {"attention": {"storage": "int4", "residual": 32}}, max_length=128)
    assert cache.nbytes() == 2 * (slots * INT4 + ring * DENSE) == cache.plan.held_nbytes(2, 50)
    with cache.block(None, 50):
        cache[0].update(torch.randn(2, 1, 50, 256), torch.randn(2, 1, 50, 256))
    assert cache.nbytes() == cache.plan.held_nbytes(2, 50)


@pytest.mark.parametrize("pattern,params", [*PATTERNS, ("tova", {"budget": 6})])
@pytest.mark.parametrize("storage", ["int4", "int8"])
def test_every_pattern_passes_the_kit_with_a_window(pattern, params, storage):
    counts = check_cache_type(pattern, params={**params, "storage": storage, "residual": 3}, cases=6)
    assert counts["split == one-shot"] >= 6 and counts["atomic failures"] > 0


def test_tova_window_holds_only_what_the_pattern_kept():
    cache = Cache.build(
        [NativeLayer("full", {"num_kv_heads": H, "head_dim": D})],
        1,
        {"attention": {"type": "tova", "budget": 4, "storage": "int4", "residual": 3}},
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        with cache.block(None, 1):
            view = cache[0].update(torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g))
            weights = torch.softmax(torch.randn(1, H, 1, view.keys.shape[2], generator=g), -1)
            cache[0].observe_attention(weights)
        held = set(cache[0].key_pos[0].tolist())
        window = {p for p in cache[0].res_pos[0].tolist() if p >= 0}
        assert window <= held and window == {p for p in held if p >= int(cache.seen[0]) - 3}


def test_crop_keeps_what_it_can_and_continues_within_the_bound():
    k, v = data(1, 14, seed=3)
    mask = torch.ones(1, 14, dtype=torch.bool)
    cache = build("full", {}, residual=4, batch=1)
    stream(cache, k, v, mask, [0, 10])
    cache.crop(7)  # window [3, 7): positions 6 still dense, 3..5 now read from their quantized copies
    keys, _ = cache[0].read()
    assert torch.equal(keys[0, :, 6], k[0, :, 6]) and not torch.equal(keys[0, :, 5], k[0, :, 5])
    stream(cache, k[:, :, 7:], v[:, :, 7:], mask[:, 7:], [0, 1, 2, 3, 4, 5, 6, 7])
    keys, _ = cache[0].read()
    assert torch.equal(keys[0, :, 10:14], k[0, :, 10:14])  # the window refills with the new tokens


BAD = [
    ({"storage": "int4", "residual": -1}, "residual must be a non-negative integer .*got -1"),
    ({"storage": "int4", "residual": 2.5}, "residual must be a non-negative integer .*got 2.5"),
    ({"storage": "int4", "residual": True}, "residual must be a non-negative integer .*got True"),
    ({"residual": 8}, "storage 'dense' is exact already"),
    ({"storage": "offload", "residual": 8}, "storage 'offload' is exact already"),
]


@pytest.mark.parametrize("entry,message", BAD)
def test_bad_residual_configs_fail_clearly(entry, message):
    with pytest.raises(CacheError, match=message):
        resolve_plan([NativeLayer("full", {"num_kv_heads": 2, "head_dim": 8})], {"attention": entry})


def test_residual_zero_is_plain_quantized_storage():
    a = build("full", {}, residual=0)
    b = build("full", {}, residual=None)
    k, v = data(2, 9)
    mask = torch.ones(2, 9, dtype=torch.bool)
    for (ak, av, _), (bk, bv, _) in zip(stream(a, k, v, mask, [0, 4, 9]), stream(b, k, v, mask, [0, 4, 9])):
        assert torch.equal(ak, bk) and torch.equal(av, bv)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    import os

    os.environ.setdefault("HYBRIDCACHE_HOME", str(tmp_path_factory.mktemp("home")))
    return hc.from_pretrained(tiny_checkpoint("gemma3"))


def test_model_generation_equals_dense_while_the_window_holds_everything(gemma):
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0
    dense = hc.generate(gemma, ids, attention_mask=mask, max_new_tokens=6)
    kivi = hc.generate(
        gemma,
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        cache_config={"attention": {"storage": "int4", "residual": 16}},
    )
    assert torch.equal(dense.sequences, kivi.sequences) and torch.equal(dense.logits, kivi.logits)
    short = hc.generate(
        gemma,
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        cache_config={"attention": {"storage": "int4", "residual": 2}},
    )
    assert not torch.equal(dense.logits, short.logits)  # older tokens quantized: a (small) difference


@pytest.mark.parametrize("max_length", [None, 32])
def test_save_and_load_round_trip(gemma, tmp_path, max_length):
    config = {"attention": {"storage": "int4", "residual": 3}}
    out = hc.generate(
        gemma,
        torch.tensor([[5, 6, 7, 8, 9, 10, 11]]),
        max_new_tokens=4,
        cache=gemma.make_cache(1, config, max_length=max_length),
    )
    out.cache.save(tmp_path / "kivi", model=gemma)
    loaded = Cache.load(tmp_path / "kivi", gemma, cache_config=None if max_length else config)
    seq = torch.cat([out.sequences, torch.tensor([[3, 4]])], 1)
    a = hc.generate(gemma, seq, max_new_tokens=3, cache=out.cache)
    b = hc.generate(gemma, seq, max_new_tokens=3, cache=loaded)
    assert torch.equal(a.logits, b.logits)
