"""Jamba specifics: cache configs that mix attention and Mamba layers, MoE routing numerics, padding and states."""

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import CacheConfigError
from hybridcache.nn.moe.topk import SparseMoE
from tests.models.conftest import prompts

# The tiny Jamba: layers M M A M (MoE at 1 and 3).
ATTENTION_LAYER = 2


@pytest.fixture(scope="module")
def jamba(models):
    return models("jamba")[0]


def test_layer_kinds(jamba):
    assert jamba.types == ["mamba", "mamba", "attention", "mamba"]
    assert [nl.type for nl in jamba.native_layers()] == ["mamba", "mamba", "full", "mamba"]
    assert [type(layer.feed_forward).__name__ for layer in jamba.model.layers] == [
        "GatedMLP",
        "SparseMoE",
        "GatedMLP",
        "SparseMoE",
    ]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"layers": {0: {"type": "full"}}}, "layer 0 is a recurrent layer"),
        ({"layers": {ATTENTION_LAYER: {"type": "mamba"}}}, f"layer {ATTENTION_LAYER} is a attention layer"),
        ({"recurrent": {"type": "sliding", "window": 4}}, "cannot use the attention cache type 'sliding'"),
        ({"recurrent": {"type": "mamba2"}}, "missing model shapes"),
        ({"mamba": {"window": 4}}, "does not take 'window'"),
    ],
)
def test_mismatched_cache_config_fails_clearly(jamba, config, message):
    with pytest.raises(CacheConfigError, match=message):
        jamba.make_cache(1, cache_config=config)
    with pytest.raises(CacheConfigError, match=message):
        hc.generate(jamba, prompts(1, 5, seed=0), max_new_tokens=2, cache_config=config)


def test_cache_of_another_model_is_refused(jamba, models):
    mamba = models("mamba")[0]
    with pytest.raises(ValueError, match="3 entries"):
        jamba(prompts(1, 5, seed=0), cache=mamba.make_cache(1))


def test_chunked_attention_config_touches_only_attention_layers(jamba):
    cache = jamba.make_cache(2, cache_config={"attention": {"type": "chunked", "chunk_size": 4}})
    assert [layer.type_name for layer in cache] == ["mamba", "mamba", "chunked", "mamba"]
    assert cache[ATTENTION_LAYER].spec.chunk_size == 4
    mamba_spec = cache[0].spec
    assert (mamba_spec.intermediate_size, mamba_spec.state_size, mamba_spec.conv_kernel) == (128, 8, 4)
    out = hc.generate(jamba, prompts(2, 11, seed=7), max_new_tokens=4, cache=cache)
    oracle = hc.generate(
        jamba,
        prompts(2, 11, seed=7),
        max_new_tokens=4,
        cache_config={"attention": {"type": "chunked", "chunk_size": 4}},
        use_cache=False,
    )
    assert torch.equal(out.sequences, oracle.sequences)


def test_moe_routing_is_unnormalised_top_k_of_float32_softmax():
    torch.manual_seed(0)
    moe = SparseMoE(16, 32, num_experts=4, top_k=2)
    x = torch.randn(2, 5, 16)
    probs = torch.softmax(moe.router(x).float(), -1)  # [B, T, E]
    expected = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        keep = probs >= probs.topk(2, dim=-1).values[..., -1:]  # the top-2 experts of each token
        expected += expert(x) * (probs[..., e] * keep[..., e])[..., None]
    assert torch.allclose(moe(x), expected, atol=1e-6)


def test_all_padding_block_leaves_mamba_states_untouched(jamba):
    cache = jamba.make_cache(2)
    ids = prompts(2, 6, seed=9)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1] = 0  # row 1: this whole block is padding
    with pytest.raises(ValueError, match="all padding"):  # meaningless logits for row 1: refused by default
        jamba(ids, cache, mask)
    assert cache.columns == 0
    jamba(ids, cache, mask, allow_padding_rows=True)
    for i in (0, 1, 3):
        for state in cache[i].states.values():
            assert bool((state[1] == 0).all()) and bool((state[0] != 0).any())
    # its real tokens then behave as if the padding never existed
    more = prompts(2, 4, seed=10)
    padded = jamba(more, cache, torch.cat([mask, torch.ones(2, 4, dtype=torch.long)], 1))[1]
    alone = jamba(more[1:])[0]
    assert (padded - alone).abs().max().item() <= 1e-5
