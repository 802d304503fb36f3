"""Every registered cache type (attention types with every storage format) passes the conformance kit, and the kit
itself catches broken types (so passing it means something)."""

import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch

from hybridcache.cache import (
    AttentionCacheLayer,
    AttentionSpec,
    RecurrentCacheLayer,
    SlidingSpec,
    available_codecs,
    available_layers,
    get_layer_class,
    load_plugins,
    register_cache_layer,
    tunable,
)
from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.cache.recurrent.codecs import available_state_codecs
from hybridcache.cache.storage.codecs import DenseCodec, codec_class, register_kv_codec
from hybridcache.testing import ConformanceError, check_cache_type

# recurrent types: every state codec (conv state included), per-head scales, and offload alone and with int8
STATE_PARAMS = [
    None,
    *({"state_codec": c, "quantize_conv": True} for c in available_state_codecs() if c != "dense"),
    {"state_codec": "int4", "state_group": "head", "quantize_conv": True},
    {"offload": True},
    {"state_codec": "int8", "offload": True, "quantize_conv": True},
]
CASES = [
    (name, codec)
    for name in available_layers()
    for codec in (
        available_codecs()
        if get_layer_class(name).kind == "attention"
        else STATE_PARAMS
        if issubclass(get_layer_class(name), RecurrentCacheLayer)
        else [None]  # a compressed type: no storage options
    )
]


def _case_id(name, codec):
    if isinstance(codec, dict):
        return "-".join([name, *(str(v) if not isinstance(v, bool) else k for k, v in codec.items())])
    return f"{name}-{codec}" if codec else name


def _row_eviction_with_grouped_storage(name, codec):
    """Layer-level storages (kivi, hf_quantized) cannot follow per-row / per-head score-based eviction."""
    return codec is not None and getattr(codec_class(codec), "grouped", False) and get_layer_class(name).own_eviction


@pytest.mark.parametrize("name,codec", CASES, ids=[_case_id(n, c) for n, c in CASES])
def test_registered_type_passes_the_kit(name, codec):
    if isinstance(codec, dict):  # a recurrent type with state storage parameters
        counts = check_cache_type(name, params=codec, cases=8)
        assert counts["atomic failures"] > 0 and counts["crop to a checkpoint (exact)"] >= 8
        return
    if _row_eviction_with_grouped_storage(name, codec):
        with pytest.raises(CacheConfigError, match="cannot follow an eviction"):
            check_cache_type(name, params={"storage": codec}, cases=1)
        return
    counts = check_cache_type(name, params={"storage": codec} if codec else None, cases=8)
    assert counts["atomic failures"] > 0 and counts["snapshot / restore"] > 0
    if get_layer_class(name).kind == "attention":
        prealloc = get_layer_class(name).supports_preallocation and getattr(codec_class(codec), "preallocates", True)
        layouts = 2 if prealloc else 1
        assert counts["split == one-shot"] == 8 * layouts
    elif issubclass(get_layer_class(name), RecurrentCacheLayer):  # every case crops a checkpointed layer back
        assert counts["crop to a checkpoint (exact)"] >= 8
    else:
        assert counts["split == one-shot"] == 8


def test_kit_catches_a_kernel_form_that_is_not_the_pattern():
    @dataclass(frozen=True, kw_only=True)
    class OffByOneSpec(AttentionSpec):  # sees `span` earlier tokens, but declares a window of `span`
        span: int = tunable()

        def visible(self, q, kv):
            return (kv <= q) & (kv >= q - self.span)

        def needed_tokens(self, seen):
            return torch.as_tensor(seen).clamp(max=self.span)

        def kernel_pattern(self):
            return "sliding", self.span  # the kernels' window counts the query itself: span + 1 is right

    @register_cache_layer("off_by_one_form_test")
    class OffByOne(AttentionCacheLayer):
        spec_cls = OffByOneSpec
        example_params = {"span": 3}

    with pytest.raises(ConformanceError, match="kernel form"):
        check_cache_type("off_by_one_form_test")
    OffByOneSpec.kernel_pattern = lambda self: ("sliding", self.span + 1)
    assert check_cache_type("off_by_one_form_test")["kernel form == visible"] == 1


def test_kit_catches_a_pattern_that_evicts_a_visible_token():
    @dataclass(frozen=True, kw_only=True)
    class ShortSpec(SlidingSpec):  # claims window W, but keeps only W-2 earlier tokens
        def needed_tokens(self, seen):
            return torch.as_tensor(seen).clamp(max=self.window - 2)

    @register_cache_layer("broken_sliding_test")
    class Broken(AttentionCacheLayer):
        spec_cls = ShortSpec
        example_params = {"window": 4}

        def _evict(self, pos, seen):
            keep = ((pos >= 0) & (pos > seen[:, None] - self.spec.window + 1)).any(0)
            return keep.nonzero().squeeze(1)

    with pytest.raises(ConformanceError, match="differs from the pattern"):
        check_cache_type("broken_sliding_test")


def test_kit_catches_a_lossy_codec_that_claims_to_be_exact():
    @register_kv_codec("fake_exact_test")
    class Rounding(DenseCodec):
        def encode(self, x):
            return {"": x.to(torch.float16).to(x.dtype)}

    with pytest.raises(ConformanceError, match="differs from the pattern"):
        check_cache_type("full", params={"storage": "fake_exact_test"})


PLUGIN = '''
"""A user's cache type in one file: keep the first token and a window (a 1-sink StreamingLLM)."""
from dataclasses import dataclass

import torch

from hybridcache.cache import AttentionCacheLayer, AttentionSpec, register_cache_layer, tunable


@dataclass(frozen=True, kw_only=True)
class FirstPlusWindowSpec(AttentionSpec):
    window: int = tunable()

    def visible(self, q, kv):
        return (kv <= q) & ((kv == 0) | (kv > q - self.window))

    def needed_tokens(self, seen):
        return seen.clamp(max=self.window) if isinstance(seen, torch.Tensor) else min(seen, self.window)


@register_cache_layer("first_plus_window")
class FirstPlusWindowLayer(AttentionCacheLayer):
    spec_cls = FirstPlusWindowSpec
    example_params = {"window": 3}
'''


def test_a_plugin_file_registers_by_name_and_passes_the_kit(tmp_path, monkeypatch):
    (tmp_path / "my_cache_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_cache_plugin", None)
    assert load_plugins(["my_cache_plugin"]) == ["first_plus_window"]
    counts = check_cache_type("first_plus_window")
    assert counts["split == one-shot"] > 0
