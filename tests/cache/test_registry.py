"""The registry: the built-in names, user-registered types, clear errors."""

from dataclasses import dataclass

import pytest
import torch

from hybridcache.cache import (
    AttentionCacheLayer,
    AttentionSpec,
    Cache,
    CacheConfigError,
    NativeLayer,
    available_layers,
    get_layer_class,
    register_cache_layer,
    tunable,
)
from tests.cache.oracle import masked_attention


def test_builtin_types_are_registered_with_their_kind():
    names = available_layers()
    for name in ("full", "sliding", "chunked", "mamba", "mamba2", "rglru", "conv"):
        assert name in names
    assert set(available_layers("attention")) >= {"full", "sliding", "chunked"}
    assert set(available_layers("recurrent")) >= {"mamba", "mamba2", "rglru", "conv"}
    assert get_layer_class("sliding").__name__ == "SlidingWindowLayer"


def test_unknown_type_lists_known_ones():
    with pytest.raises(CacheConfigError, match="unknown cache type 'nope'; known types: .*full.*sliding"):
        get_layer_class("nope")


@dataclass(frozen=True, kw_only=True)
class SinkSpec(AttentionSpec):
    """StreamingLLM: the first `sinks` tokens plus a sliding window."""

    window: int = tunable()
    sinks: int = tunable(2)

    def visible(self, q, kv):
        return (kv <= q) & ((kv < self.sinks) | (kv > q - self.window))

    def needed_tokens(self, seen):
        return (
            seen.clamp(max=self.sinks + self.window - 1)
            if isinstance(seen, torch.Tensor)
            else min(seen, self.sinks + self.window - 1)
        )


def test_user_registered_type_works_in_configs_and_evicts():
    @register_cache_layer("sink_test")
    class SinkLayer(AttentionCacheLayer):
        spec_cls = SinkSpec

    assert "sink_test" in available_layers("attention")
    native = [NativeLayer("full", {"num_kv_heads": 1, "head_dim": 2})]
    cache = Cache.build(native, 1, {"attention": {"type": "sink_test", "window": 3}})
    layer = cache[0]
    k = torch.randn(1, 1, 12, 2)
    for t in range(12):
        with cache.block(None, 1):
            view = layer.update(k[:, :, t : t + 1], k[:, :, t : t + 1])
    # the last query (position 11) sees sinks 0, 1 and the window 9, 10, 11
    assert sorted(view.key_positions[0][view.mask[0, 0]].tolist()) == [0, 1, 9, 10, 11]
    assert sorted(p for p in layer.key_positions()[0].tolist() if p >= 0) == [0, 1, 10, 11]
    out = masked_attention(k[:, :, 11:], view.keys, view.values, view.mask)
    ref = masked_attention(
        k[:, :, 11:], k[:, :, [0, 1, 9, 10, 11]], k[:, :, [0, 1, 9, 10, 11]], torch.ones(1, 1, 5, dtype=torch.bool)
    )
    assert torch.allclose(out, ref, atol=1e-6)


def test_registration_errors():
    with pytest.raises(CacheConfigError, match="already registered"):
        register_cache_layer("full")(type("Other", (AttentionCacheLayer,), {"spec_cls": AttentionSpec}))
    with pytest.raises(CacheConfigError, match="reserved"):
        register_cache_layer("attention")
    with pytest.raises(CacheConfigError, match="CacheLayer subclass"):
        register_cache_layer("thing")(object)
    # one class under a second name would silently rename a registered type
    existing = get_layer_class("sliding")
    with pytest.raises(CacheConfigError, match="already registered as 'sliding'"):
        register_cache_layer("sliding_again_test")(existing)
    assert get_layer_class("sliding") is existing and "sliding_again_test" not in available_layers()


def test_kv_codec_registration_errors():
    from hybridcache.cache.storage.codecs import DenseCodec, available_codecs, get_codec, register_kv_codec

    with pytest.raises(CacheConfigError, match="already registered"):
        register_kv_codec("dense")(type("OtherDense", (DenseCodec,), {}))
    with pytest.raises(CacheConfigError, match="already registered as storage 'dense'"):
        register_kv_codec("dense_again_test")(DenseCodec)
    assert DenseCodec.name == "dense" and "dense_again_test" not in available_codecs()
    assert type(get_codec("dense")) is DenseCodec
    with pytest.raises(CacheConfigError, match="KVCodec subclass"):
        register_kv_codec("thing_test")(object)


def test_entry_point_plugins_register_types(tmp_path, monkeypatch):
    """A package declaring a module under the `hybridcache.cache_layers` entry-point group gets its types into
    configs with no import by the user; a broken entry point names itself."""
    from importlib import metadata

    from hybridcache.cache.core import registry

    (tmp_path / "ep_plugin_test.py").write_text(
        "from dataclasses import dataclass\n"
        "from hybridcache.cache import AttentionSpec, register_cache_layer\n"
        "from hybridcache.cache.attention.layer import SlidingWindowLayer\n"
        "@register_cache_layer('ep_window_test')\n"
        "class EpWindow(SlidingWindowLayer):\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    good = metadata.EntryPoint(name="ep", value="ep_plugin_test", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [good] if group == good.group else [])
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    assert "ep_window_test" in available_layers("attention")
    native = [NativeLayer("full", {"num_kv_heads": 1, "head_dim": 2})]
    cache = Cache.build(native, 1, {"attention": {"type": "ep_window_test", "window": 3}})
    assert type(cache[0]).__name__ == "EpWindow"

    bad = metadata.EntryPoint(name="broken", value="no_such_module_test_xyz", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [bad])
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    with pytest.raises(CacheConfigError, match="entry point 'broken'.*failed to load"):
        available_layers()
