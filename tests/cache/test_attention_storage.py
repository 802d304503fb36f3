"""The attention storage protocol (hybridcache/cache/attention/storage/): one storage object per layer, chosen once.

- the save format and the stored values are those of the code before storages were objects (a file it wrote:
  tests/cache/data/attention_layout_v1.safetensors, made by make_attention_layout.py at commit 7d1ca1b);
- every per-token storage kind, fed blocks of any length with padding, gives each block a view that a naive
  recompute predicts: exactly the positions the pattern shows, each key / value either as fed or (quantized
  storage) its codec round trip, the residual window's and the block's own tokens as fed;
- an offloaded storage wrapping int8 (dynamic, and preallocated with a residual window) equals int8 alone.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridcache.cache import Cache, NativeLayer
from hybridcache.cache.attention.storage import (
    AppendStorage,
    CodecStorage,
    GroupedStorage,
    OffloadedStorage,
    StaticStorage,
)
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.storage.codecs import get_codec

DATA = Path(__file__).parent / "data"
HEADS, DIM = 2, 8


def _layout_script():
    spec = importlib.util.spec_from_file_location("make_attention_layout", DATA / "make_attention_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAYOUT = _layout_script()


@pytest.mark.parametrize("scenario", sorted(LAYOUT.SCENARIOS))
def test_saved_tensors_are_those_the_code_before_storage_objects_wrote(scenario, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDCACHE_OFFLOAD_DIR", str(tmp_path))
    saved = load_file(DATA / "attention_layout_v1.safetensors")
    recorded = {k[len(scenario) + 1 :]: t for k, t in saved.items() if k.startswith(f"{scenario}.")}
    config, max_length = LAYOUT.SCENARIOS[scenario]
    got = LAYOUT.run(config, max_length)
    got.update({f"full_only.{k}": t for k, t in LAYOUT.run(config, max_length, LAYOUT.NATIVE[:1]).items()})
    assert sorted(got) == sorted(recorded)  # the same tensor names (the save format), the same steps succeeded
    for name, t in recorded.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


STORAGES = {  # cache config, max_length -> the storage class the factory picks
    "dense": ({}, None, AppendStorage),
    "dense_static": ({}, 24, StaticStorage),
    "int8": ({"storage": "int8"}, None, CodecStorage),
    "int8_residual": ({"storage": "int8", "residual": 3}, None, CodecStorage),
    "int8_residual_static": ({"storage": "int8", "residual": 3}, 24, StaticStorage),
    "offload": ({"storage": "offload"}, None, OffloadedStorage),
    "offload_static": ({"storage": "offload"}, 24, OffloadedStorage),
    "kivi": ({"storage": "kivi", "q_group_size": 4, "residual": 4}, None, GroupedStorage),
}
PATTERNS = {
    "full": NativeLayer("full", dict(num_kv_heads=HEADS, head_dim=DIM)),
    "sliding": NativeLayer("sliding", dict(num_kv_heads=HEADS, head_dim=DIM, window=4)),
}
BLOCKS = [4, 1, 1, 3, 1, 1, 1, 5, 1, 1]


def _cache(pattern, kind, batch=2):
    config, max_length, _ = STORAGES[kind]
    return Cache.build([PATTERNS[pattern]], batch, {"attention": config} if config else None, max_length=max_length)


@pytest.mark.parametrize("kind", sorted(STORAGES))
def test_the_factory_picks_one_storage_and_only_appended_storage_takes_kernel_writes(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDCACHE_OFFLOAD_DIR", str(tmp_path))
    layer = _cache("full", kind).layers[0]
    assert type(layer.storage) is STORAGES[kind][2]
    assert layer.writes_slots() == (kind == "dense")  # only dense float32 appended in place
    assert (layer.reserve_slots(4) is not None) == (kind == "dense")
    if kind == "offload_static":
        assert type(layer.storage.inner) is StaticStorage


def _feed_and_check(pattern, kind, seed=0):
    """Feed BLOCKS (row 1 left-padded by 2 in the first) and check each view against a naive recompute."""
    cache = _cache(pattern, kind)
    layer = cache.layers[0]
    spec = layer.spec
    codec = get_codec(spec.storage, q_group_size=spec.q_group_size) if spec.storage != "offload" else None
    residual = spec.residual or 0
    g = torch.Generator().manual_seed(seed)
    fed: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{}, {}]  # row -> position -> (k, v) [H, D]
    for i, tokens in enumerate(BLOCKS):
        valid = torch.ones(2, tokens, dtype=torch.bool)
        if i == 0:
            valid[1, :2] = False
        seen_before = cache.seq.seen.clone()
        k, v = torch.randn(2, HEADS, tokens, DIM, generator=g), torch.randn(2, HEADS, tokens, DIM, generator=g)
        with cache.block(valid, tokens):
            view = layer.update(k, v)
            keys, values, kpos = view.keys.clone(), view.values.clone(), view.key_positions.clone()
        for row in range(2):
            real = valid[row].nonzero().squeeze(1).tolist()
            new = {}
            for n, t in enumerate(real):
                new[int(seen_before[row]) + n] = (k[row, :, t], v[row, :, t])
            fed[row].update(new)
            q = int(seen_before[row]) + len(real) - 1  # the block's last real query
            want = {p for p in fed[row] if bool(spec.visible(torch.tensor(q), torch.tensor(p)))}
            slots = {int(p): s for s, p in enumerate(kpos[row].tolist()) if p >= 0 and p in want}
            assert set(slots) == want, (i, row)  # the view holds every position the pattern shows
            for p, s in slots.items():
                for got, ref in ((keys[row, :, s], fed[row][p][0]), (values[row, :, s], fed[row][p][1])):
                    dense = codec is None or codec.exact or p in new or p >= int(seen_before[row]) - residual
                    if not dense:  # its stored form: the codec's round trip of what was fed
                        ref = codec.decode(codec.encode(ref[None, :, None]), ref.dtype)[0, :, 0]
                    assert torch.equal(got, ref), (i, row, p)
    return cache


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("kind", [k for k in sorted(STORAGES) if k != "kivi"])
def test_every_per_token_storage_gives_the_view_a_naive_recompute_predicts(pattern, kind, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDCACHE_OFFLOAD_DIR", str(tmp_path))
    _feed_and_check(pattern, kind)


def _wrapped_pair(config, max_length):
    """Two caches of the same int8 layer; the second's storage wrapped in an OffloadedStorage."""
    caches = [Cache.build([PATTERNS["full"]], 2, {"attention": config}, max_length=max_length) for _ in range(2)]
    layer = caches[1].layers[0]
    layer.storage = OffloadedStorage(layer.storage, layer)
    return caches


@pytest.mark.parametrize("max_length", [None, 24])
def test_offload_wrapping_int8_equals_int8_alone(max_length, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDCACHE_OFFLOAD_DIR", str(tmp_path))
    config = {"storage": "int8", "residual": 3}
    alone, wrapped = _wrapped_pair(config, max_length)
    g = torch.Generator().manual_seed(1)
    for i, tokens in enumerate(BLOCKS):
        valid = torch.ones(2, tokens, dtype=torch.bool)
        if i == 0:
            valid[1, :1] = False
        k, v = torch.randn(2, HEADS, tokens, DIM, generator=g), torch.randn(2, HEADS, tokens, DIM, generator=g)
        views = []
        for cache in (alone, wrapped):
            with cache.block(valid, tokens):
                view = cache.layers[0].update(k, v)
                views.append((view.keys.clone(), view.values.clone(), view.key_positions.clone()))
        assert all(torch.equal(a, b) for a, b in zip(*views)), i
        layer = wrapped.layers[0]
        for name in layer.storage.inner.parts:  # parked between blocks, in a (unlinked) memory-mapped file
            assert getattr(layer, name) is layer.storage.tier.parked[name]
            assert getattr(layer, name).untyped_storage().filename
    for cache in (alone, wrapped):
        cache.crop(cache.columns - 1)
        cache.select(torch.tensor([1, 1, 0]))
    a, b = alone.layers[0], wrapped.layers[0]
    assert a.nbytes() == b.nbytes()
    assert a._state_tensors().keys() == b._state_tensors().keys()
    assert all(torch.equal(t, b._state_tensors()[n]) for n, t in a._state_tensors().items())


def test_a_grouped_storage_refuses_to_keep_slots_per_row():
    layer = _cache("full", "kivi").layers[0]
    with pytest.raises(CacheError, match="cannot keep slots per row"):
        layer.storage.take(torch.zeros(2, 1, dtype=torch.long))
