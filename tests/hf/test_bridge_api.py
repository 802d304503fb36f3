"""cache_for's contract: what it builds (the plan from HF's layout, our cache config schema with HF's layer
indices), named errors before any work (the model left untouched), the installation (HF's attention implementation
switched to the bridge's and back), where storage lives, and the cache refusing another model."""

import pytest
import torch
from transformers import DynamicCache

from hybridcache.cache import CacheConfigError, CacheError
from hybridcache.hf import BridgeCache, BridgeConfigError, BridgeError, cache_for, uninstall
from tests.hf.conftest import hf_generate, max_diff, prompts


def test_native_plan_follows_hf_layer_types(pair):
    hf, _ = pair("gemma3")
    cache = cache_for(hf)
    hf_types = hf.config.get_text_config().layer_types
    assert [p.type for p in cache.plan.layers] == [t.split("_")[0] for t in hf_types]
    window = hf.config.get_text_config().sliding_window
    assert all(p.spec.window == window for p in cache.plan.layers if p.type == "sliding")
    hf2, _ = pair("falcon_h1")
    assert cache_for(hf2).plan.structure[0] == ("attention", "mamba2")  # HF's hybrid layer: a group


def test_layers_keys_are_hf_decoder_layer_indices(hf_tiny):
    """Nemotron-H has MLP-only decoder layers (no cache): `layers:` still counts HF's decoder layers."""
    hf = hf_tiny("nemotron_h")
    types = hf.config.layer_types
    attn = types.index("full_attention") if "full_attention" in types else types.index("attention")
    cache = cache_for(hf, {"layers": {attn: {"type": "sliding", "window": 4}}})
    assert [p.type for p in cache.plan.layers].count("sliding") == 1
    empty = next(i for i, layer in enumerate(cache.layers) if type(layer).__name__ == "DummyLayer")
    with pytest.raises(BridgeConfigError, match=f"decoder layer {empty} .* keeps no cache"):
        cache_for(hf, {"layers": {empty: {"type": "sliding", "window": 4}}})
    with pytest.raises(BridgeConfigError, match="out of range"):
        cache_for(hf, {"layers": {len(types): {"type": "sliding", "window": 4}}})


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"attention": {"type": "nope"}}, "unknown cache type"),
        ({"attention": {"type": "sliding", "window": 0}}, "window"),
        ({"recurrent": {"type": "full"}}, "cannot use the attention cache type"),
        ({"attention": {"window": 4, "bogus": 1}}, "bogus"),
        ({"layers": {"x": {}}}, "indices"),
    ],
)
def test_bad_configs_are_named_errors_before_any_work(hf_tiny, config, match):
    hf = hf_tiny("jamba")
    with pytest.raises(CacheConfigError, match=match):
        cache_for(hf, config)
    assert not hf._forward_pre_hooks  # nothing installed


def test_bad_arguments(hf_tiny):
    with pytest.raises(BridgeError, match="PreTrainedModel"):
        cache_for(torch.nn.Linear(2, 2))
    with pytest.raises(BridgeError, match="batch_size"):
        cache_for(hf_tiny("llama"), batch_size=0)


def test_install_and_uninstall(hf_tiny):
    """cache_for keeps the model's attention implementation (and its name: modeling code branches on it) and wraps
    HF's function in place; the wrapper passes every call without a BridgeCache through unchanged."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hf = hf_tiny("llama")
    base = hf.config._attn_implementation
    ids, mask = prompts(2, 6, seed=15, pad=1)
    ref = hf_generate(hf, ids, mask)
    cache_for(hf)
    assert hf.config._attn_implementation == base
    assert ALL_ATTENTION_FUNCTIONS[base].__name__.startswith("hybridcache_")
    other = hf_generate(hf, ids, mask, cache=DynamicCache(config=hf.config))  # not ours: HF's own path
    assert torch.equal(other[0], ref[0]) and max_diff(other[1], ref[1]) == 0
    uninstall(hf)
    assert not hf._forward_pre_hooks and not hf.model._forward_pre_hooks


def test_a_cache_serves_only_its_model(hf_tiny):
    a, b = hf_tiny("llama"), hf_tiny("llama", seed=1)
    cache = cache_for(a)
    cache_for(b)
    ids, mask = prompts(1, 4, seed=16)
    with pytest.raises(BridgeError, match="another model"), torch.no_grad():
        b(input_ids=ids, attention_mask=mask, cache=cache)


def test_batch_size_builds_now_and_storage_lives_where_keys_arrive(hf_tiny):
    hf = hf_tiny("qwen3_next")
    cache = cache_for(hf, batch_size=2)
    assert isinstance(cache, BridgeCache) and cache.hybrid is not None and cache.hybrid.batch_size == 2
    device = hf.get_input_embeddings().weight.device
    assert cache.hybrid.device == device
    for layer in cache.hybrid.layers:
        assert all(t.device == device for t in layer.snapshot().tensors.values())
    lazy = cache_for(hf)
    assert lazy.hybrid is None and lazy.batch_size == -1  # built by the first forward, for its batch


def _stale_probe(model, device: str) -> None:
    """Make the model's recorded layout say its cached layers live on `device`: what a probe says of a model moved
    to another device after it (a CPU-only stand-in for a model whose keys arrive elsewhere than its probe saw)."""
    from dataclasses import replace

    from hybridcache.hf import build

    layout = build.layout_of(model)
    moved = tuple(
        replace(
            info,
            attention=None if info.attention is None else replace(info.attention, device=torch.device(device)),
            states=None if info.states is None else replace(info.states, device=torch.device(device)),
        )
        for info in layout.layers
    )
    build._LAYOUTS[model] = replace(layout, layers=moved, input_device=torch.device(device))


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_the_cache_is_built_where_the_first_keys_arrive(hf_tiny, family):
    """Lazy initialization: our cache is built by the first forward on the device of the keys HF's layers hand it,
    not where the model's probe saw them (here a probe that says "meta" while the model runs on the CPU)."""
    hf = hf_tiny(family)
    ids, mask = prompts(2, 6, seed=18, pad=2)
    want, _ = hf_generate(hf, ids, mask)
    _stale_probe(hf, "meta")
    cache = cache_for(hf)
    got, _ = hf_generate(hf, ids, mask, cache=cache)
    assert cache.hybrid.device == torch.device("cpu") and torch.equal(got, want)
    for layer in cache.hybrid.layers:
        assert all(t.device.type == "cpu" for t in layer.snapshot().tensors.values())


def test_keys_on_another_device_than_the_cache_are_refused_by_name(hf_tiny):
    """A model whose attention layer hands its keys from another device than the cache was built on (its Mamba
    layers, on the CPU, built it): here Jamba's attention projections move their outputs to "meta", the CPU-only
    stand-in for a second device. A named error that says both devices; the forward changed nothing."""
    hf = hf_tiny("jamba")
    cache = cache_for(hf)
    ids, mask = prompts(1, 4, seed=19)
    attention = next(m for m in hf.modules() if type(m).__name__.endswith("Attention"))
    handles = [p.register_forward_hook(lambda m, a, out: out.to("meta")) for p in (attention.k_proj, attention.v_proj)]
    try:
        with pytest.raises(BridgeError, match="keys arrive on meta, and this cache lives on cpu"), torch.no_grad():
            hf(input_ids=ids, attention_mask=mask, cache=cache)
    finally:
        for h in handles:
            h.remove()
    assert cache.columns == 0 and not cache.block_open
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=mask, cache=cache)  # the same cache serves the model afterwards
    assert cache.columns == 4


def test_a_mask_with_padding_after_tokens_is_refused(hf_tiny):
    hf = hf_tiny("llama")
    ids, mask = prompts(1, 5, seed=17)
    mask[0, 2] = 0  # a hole: not left padding
    with pytest.raises(CacheError, match="left padding"), torch.no_grad():
        hf(input_ids=ids, attention_mask=mask, cache=cache_for(hf))


def test_sparse_attention_layers_are_served_native_only(pair):
    """GLM5-Next's DSA layers (keys, values and indexer keys: a group {attention, indexer} of ours) give HF's own
    cache's tokens natively; re-typing them is refused by name, since the indexer's selection reaches attention inside
    HF's mask, which only describes the native layout."""
    hf, ours = pair("glm5_next")
    ids, mask = prompts(2, 7, seed=18, pad=2)
    cache = cache_for(hf)
    assert ("attention", "indexer") in cache.plan.structure
    seq, logits = hf_generate(hf, ids, mask, cache=cache)
    ref_seq, ref_logits = hf_generate(hf, ids, mask)
    assert torch.equal(seq, ref_seq) and max_diff(logits, ref_logits) < 1e-4
    with pytest.raises(BridgeConfigError, match="sparse attention"):
        cache_for(hf, {"attention": {"type": "sliding", "window": 4}})
    assert cache_for(hf, {"attention": {"storage": "int8"}}).plan  # HF's mask still describes int8 slots


def test_other_models_of_a_bridged_family_are_untouched(hf_tiny):
    """The wrappers (HF's sdpa entry, a modeling file's eager function) pass every call without a BridgeCache through:
    a model of the same family that is not bridged gives bit-identical results before and after another is."""
    for family in ("gemma2", "llama"):  # eager and sdpa by default
        a, b = hf_tiny(family), hf_tiny(family, seed=1)
        ids, mask = prompts(2, 6, seed=19, pad=1)
        before = hf_generate(b, ids, mask)
        hf_generate(a, ids, mask, cache=cache_for(a, {"attention": {"type": "sliding", "window": 3}}))
        after = hf_generate(b, ids, mask)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
