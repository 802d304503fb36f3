"""Cache configs: precedence (kind < native type name < layer index), clear errors, the plan table."""

import pytest
import torch
from omegaconf import OmegaConf

from hybridcache.cache import Cache, CacheConfigError, NativeLayer, resolve_plan
from hybridcache.tools.report import render_plan
from tests.cache.helpers import NATIVE

# a Gemma3/Jamba-like mix: 0 mamba, 1 sliding(4), 2 full, 3 sliding(4), 4 full
MODEL = [NATIVE["mamba"], NATIVE["sliding"], NATIVE["full"], NATIVE["sliding"], NATIVE["full"]]


def types(plan):
    return [p.type for p in plan.layers]


def test_native_plan_keeps_model_types():
    plan = resolve_plan(MODEL)
    assert types(plan) == ["mamba", "sliding", "full", "sliding", "full"]
    assert plan[1].spec.window == 4


def test_kind_group_sets_every_attention_layer():
    plan = resolve_plan(MODEL, {"attention": {"type": "chunked", "chunk_size": 64}})
    assert types(plan) == ["mamba", "chunked", "chunked", "chunked", "chunked"]
    assert {p.spec.chunk_size for p in plan.layers[1:]} == {64}


def test_type_name_group_beats_kind_group_and_layer_beats_both():
    config = {
        "attention": {"type": "chunked", "chunk_size": 8},
        "full": {"type": "sliding", "window": 128},
        "layers": {4: {"type": "full"}, "3": {"chunk_size": 2}},
    }
    plan = resolve_plan(MODEL, config)
    assert types(plan) == ["mamba", "chunked", "sliding", "chunked", "full"]
    assert plan[2].spec.window == 128 and plan[1].spec.chunk_size == 8 and plan[3].spec.chunk_size == 2
    with pytest.raises(CacheConfigError, match="layers.1.window: layer 1 resolves to cache type 'chunked'"):
        resolve_plan(MODEL, {**config, "layers": {1: {"window": 2}}})


def test_native_parameters_are_kept_and_overridable():
    assert resolve_plan(MODEL, {"sliding": {"window": 9}})[1].spec.window == 9
    assert resolve_plan(MODEL, {"layers": {3: {"window": 2}}})[3].spec.window == 2
    assert resolve_plan(MODEL, {"layers": {3: {"window": 2}}})[1].spec.window == 4


def test_max_length_preallocates_attention_only():
    plan = resolve_plan(MODEL, {"layers": {2: {"max_length": 32}}}, max_length=16)
    assert [getattr(p.spec, "max_length", "-") for p in plan.layers] == ["-", 16, 32, 16, 16]


def test_omegaconf_configs_and_string_layer_keys():
    cfg = OmegaConf.create({"attention": {"type": "sliding", "window": 3}, "layers": {"2": {"type": "full"}}})
    assert types(resolve_plan(MODEL, cfg)) == ["mamba", "sliding", "full", "sliding", "sliding"]


def test_recurrent_state_dtype_override():
    plan = resolve_plan(MODEL, {"recurrent": {"state_dtype": torch.float64}})
    assert plan[0].spec.state_dtype == torch.float64


ERRORS = [
    (
        {"attention": {"type": "slidng"}},
        r"unknown cache type 'slidng'; known types: (\w+, )*chunked, (\w+, )*conv, (\w+, )*full, (\w+, )*sliding",
    ),
    ({"layers": {0: {"type": "full"}}}, "layer 0 is a recurrent layer .* cannot use the attention cache type 'full'"),
    ({"attention": {"type": "mamba"}}, "layer 1 is a attention layer .* cannot use the recurrent cache type 'mamba'"),
    ({"layers": {1: {"type": "rglru"}}}, "cannot use the recurrent cache type 'rglru'"),
    ({"recurrent": {"type": "mamba2"}}, "cannot use cache type 'mamba2': missing model shapes"),
    ({"attention": {"type": "sliding", "window": 0}}, "window must be a positive integer, got 0"),
    ({"attention": {"type": "chunked", "chunk_size": -3}}, "chunk_size must be a positive integer, got -3"),
    ({"attention": {"max_length": 0}}, "max_length must be a positive integer, got 0"),
    ({"attention": {"type": "sliding", "window": 2.5}}, "window must be a positive integer, got 2.5"),
    ({"recurrent": {"state_dtype": torch.int32}}, "state_dtype must be a floating-point dtype, got torch.int32"),
    ({"recurrent": {"state_dtype": torch.bool}}, "state_dtype must be a floating-point dtype, got torch.bool"),
    ({"attention": {"storage": "int3"}}, r"unknown attention storage 'int3'; known: (\w+, )*dense, (\w+, )*int8"),
    ({"layers": {5: {"type": "full"}}}, "layers.5: layer index out of range .*5 layers"),
    ({"layers": {"x": {"type": "full"}}}, "layers.x: layer keys are indices"),
    (
        {"attention": {"type": "chunked", "chunksize": 8}},
        "attention.chunksize: unknown parameter for cache type 'chunked'",
    ),
    ({"attention": {"type": "full", "num_kv_heads": 8}}, "num_kv_heads: unknown parameter .*accepted: .*max_length"),
    ({"full": {"type": "sliding"}}, "layer 2 .* cannot use cache type 'sliding': missing parameter window"),
    ({"atention": {"type": "full"}}, "unknown key 'atention'"),
    ({"attention": "chunked"}, "'attention' must be a mapping"),
    ({"full": {"window": 3}}, "layer 2 resolves to cache type 'full', which does not take 'window'"),
    ({"recurrent": {"windw": 3}}, "recurrent.windw: no recurrent cache type takes .windw."),
]


@pytest.mark.parametrize("config,message", ERRORS)
def test_bad_configs_fail_clearly(config, message):
    with pytest.raises(CacheConfigError, match=message):
        resolve_plan(MODEL, config)


def test_plan_table_lists_every_layer_with_bytes():
    plan = resolve_plan(MODEL, {"attention": {"type": "chunked", "chunk_size": 64}})
    text = render_plan(plan, batch=2, tokens=100)
    assert "chunk_size=64" in text and "mamba" in text and "batch 2 after 100 tokens" in text
    # chunked(64) after 100 tokens holds 36 tokens of 2 heads x 4 dims x (k + v) x fp32, batch 2
    assert plan[1].spec.held_nbytes(2, 100) == 2 * 36 * 2 * 2 * 4 * 4
    records = plan.to_records(2, 100)
    assert [r["type"] for r in records] == types(plan) and records[1]["chunk_size"] == 64


def test_cache_build_uses_the_plan():
    cache = Cache.build(MODEL, 3, {"attention": {"type": "sliding", "window": 2}})
    assert [layer.type_name for layer in cache] == ["mamba", "sliding", "sliding", "sliding", "sliding"]
    assert cache.batch_size == 3 and cache.plan is not None


def test_kind_wide_parameters_apply_where_the_type_takes_them():
    attn = {"num_kv_heads": 1, "head_dim": 4}
    native = [NativeLayer("sliding", {**attn, "window": 8}), NativeLayer("full", attn)]
    plan = resolve_plan(native, {"attention": {"window": 3}})
    assert plan[0].spec.window == 3 and plan[1].type == "full" and "window" not in plan[1].spec.params()
    with pytest.raises(CacheConfigError, match="attention.window: no attention layer of this model takes 'window'"):
        resolve_plan([native[1]], {"attention": {"window": 3}})
