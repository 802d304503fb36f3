"""`storage: kivi` / `storage: hf_quantized` wired into attention cache layers: a layer computes exactly what the
storage computes on its own, bytes follow the spec's formulas, refusals are clear CacheConfigErrors, and a model's
cache with them saves, loads and continues bit-exactly (gemma3: full and sliding layers)."""

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import Cache, CacheConfigError, NativeLayer
from hybridcache.cache.storage.hf_quantized import HFQuantizedStorage
from hybridcache.cache.storage.kivi import KiviStorage
from hybridcache.checkpoints.tiny import tiny_checkpoint

SHAPES = {"num_kv_heads": 2, "head_dim": 8, "dtype": torch.float32}
KIVI = {"storage": "kivi", "nbits": 2, "q_group_size": 4, "residual": 8}
HFQ = {"storage": "hf_quantized", "nbits": 4, "q_group_size": 8, "residual": 4}


def build(type_, params, batch=1):
    return Cache.build([NativeLayer("full", SHAPES)], batch, {"layers": {0: {"type": type_, **params}}})


def feed(cache, k, v, splits):
    out, start = [], 0
    for n in splits:
        with cache.block(None, n):
            view = cache[0].update(k[:, :, start : start + n], v[:, :, start : start + n])
        out.append((view.keys, view.values))
        start += n
    return out


@pytest.mark.parametrize(
    "params,storage",
    [
        (KIVI, lambda: KiviStorage(2, 2, 8, torch.float32, bits=2, group_size=4, residual_length=8)),
        (HFQ, lambda: HFQuantizedStorage(2, 2, 8, torch.float32, nbits=4, q_group_size=8, residual_length=4)),
    ],
)
def test_a_layer_attends_to_exactly_what_its_storage_computes(params, storage):
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 30, 8, generator=g) for _ in range(2))
    splits = [7, 1, 1, 5, 1, 1, 1, 9, 1, 1, 1, 1]
    ref, start = storage(), 0
    for (keys, values), n in zip(feed(build("full", params, 2), k, v, splits), splits):
        staged = ref.prepare(
            k[:, :, start : start + n], v[:, :, start : start + n], torch.arange(start, start + n).expand(2, -1)
        )
        ref.commit(staged)
        assert torch.equal(keys, staged.keys) and torch.equal(values, staged.values)
        start += n


@pytest.mark.parametrize(
    "type_,extra",
    [("full", {}), ("sliding", {"window": 6}), ("chunked", {"chunk_size": 8}), ("sink", {"window": 4, "sinks": 2})],
)
def test_bytes_are_what_the_spec_says(type_, extra):
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, 2, 29, 8, generator=g) for _ in range(2))
    kivi, hfq = build(type_, {**KIVI, **extra}), build(type_, {**HFQ, **extra})
    start = 0
    for n in [5, 1, 1, 1, 4, 1, 9, 1, 1, 1, 1, 1, 1, 1]:
        feed(kivi, k[:, :, start:], v[:, :, start:], [n])
        feed(hfq, k[:, :, start:], v[:, :, start:], [n])
        start += n
        assert kivi[0].nbytes() == kivi[0].spec.min_nbytes(1, start)  # KIVI: a function of the count alone
        assert hfq[0].spec.min_nbytes(1, start) <= hfq[0].nbytes() <= hfq[0].spec.max_nbytes(1, start)
    if type_ == "sliding":  # key groups and value tokens that left the window are gone
        assert kivi[0].key_pos.shape[1] < start


def test_refusals_are_clear():
    with pytest.raises(CacheConfigError, match="cannot follow an eviction"):
        build("tova", {**KIVI, "budget": 5})
    with pytest.raises(CacheConfigError, match="cannot follow an eviction"):
        build("snapkv", {**HFQ, "budget": 5})
    with pytest.raises(CacheConfigError, match="max_length"):
        build("full", {**KIVI, "max_length": 32})
    with pytest.raises(CacheConfigError, match="residual_length must be a positive multiple"):
        build("full", {**KIVI, "residual": 6})
    with pytest.raises(CacheConfigError, match="does not take nbits"):
        build("full", {"storage": "int4", "nbits": 2})
    with pytest.raises(CacheConfigError, match="axis_key"):
        build("full", {**KIVI, "axis_key": 0})
    with pytest.raises(CacheConfigError, match="axis_key must be 0 or -1"):
        build("full", {**HFQ, "axis_key": 1})


@pytest.mark.parametrize("params", [KIVI, HFQ, {**HFQ, "axis_key": -1, "axis_value": -1, "q_group_size": 2}])
def test_a_model_cache_saves_loads_and_continues_bit_exactly(params, tmp_path):
    model = hc.from_pretrained(tiny_checkpoint("gemma3"), dtype=torch.float32)
    ids = torch.randint(3, 384, (2, 20), generator=torch.Generator().manual_seed(0))
    cache = model.make_cache(2, {"attention": params})
    model(ids[:, :11], cache=cache)
    for t in range(11, 14):
        model(ids[:, t : t + 1], cache=cache)
    cache.save(tmp_path / "c.safetensors", model=model)
    loaded = Cache.load(tmp_path / "c.safetensors", model=model)
    snap = cache.snapshot()
    a = model(ids[:, 14:], cache=cache)
    b = model(ids[:, 14:], cache=loaded)
    assert torch.equal(getattr(a, "logits", a), getattr(b, "logits", b))
    cache.restore(snap)
    again = model(ids[:, 14:], cache=cache)
    assert torch.equal(getattr(a, "logits", a), getattr(again, "logits", again))
