"""The families with learned attention sinks (GraniteSWA, GPT-OSS) with sinks far from their HF initialisation.

The tiny checkpoints keep HF's initial sinks (GraniteSWA: zeros), so here each sink is redrawn from N(0, 1.5^2):
every attention path (prefill, decode steps, chunked prefill, left padding, sliding and chunked cache types, the
score-based eviction methods) must still match HF and the full recompute. HF's GraniteSWA applies its sinks as
sigmoid(logsumexp - sink) after the softmax, GPT-OSS as an extra softmax column: both compared here."""

import pytest
import torch
import transformers

import hybridcache as hc
from hybridcache.checkpoints.tiny import reinit_weights_, tiny_config
from hybridcache.checkpoints.tiny_recipes import FAMILY_RECIPES
from tests.models.conftest import hf_generate, prompts

FAMILIES = ["granite_swa", "gpt_oss"]
F64 = {"recurrent": {"state_dtype": torch.float64}}


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module")
def sink_models(tmp_path_factory):
    loaded = {}

    def get(family):
        if family not in loaded:
            config = tiny_config(family)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                ref = getattr(transformers, FAMILY_RECIPES[family][1])(config).float().eval()
            reinit_weights_(ref, config, seed=0)
            gen = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for layer in ref.model.layers:
                    layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen) * 1.5)
            path = tmp_path_factory.mktemp(family)
            ref.save_pretrained(path)
            ours = hc.from_pretrained(path, dtype=torch.float32)
            exact = hc.from_pretrained(path, dtype=torch.float64)
            loaded[family] = ours, exact, ref
        return loaded[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_sinks_are_loaded_and_left_padded_generation_matches_hf(family, sink_models):
    ours, _, ref = sink_models(family)
    assert ours.model.layers[0].self_attn.sinks.abs().max() > 0.5  # the redrawn sinks, not zeros
    ids = prompts(1, 21, seed=1)
    with torch.no_grad():
        assert max_diff(ours(ids), ref(ids).logits) <= 1e-4
    lengths = [21, 9, 14]
    ids = torch.zeros(3, 21, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, 21 - n :], mask[r, 21 - n :] = prompts(1, n, seed=10 + n)[0], 1
    out = hc.generate(ours, ids, attention_mask=mask, max_new_tokens=16)
    sequences, logits = hf_generate(ref, ids, mask, 16)
    assert torch.equal(out.sequences, sequences)
    assert max_diff(out.logits, logits) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "config",
    [None, {"attention": {"type": "sliding", "window": 6}}, {"attention": {"type": "chunked", "chunk_size": 5}}],
    ids=["native", "sliding6", "chunked5"],
)
def test_cached_decode_and_chunked_prefill_equal_recompute_in_float64(family, config, sink_models):
    _, exact, _ = sink_models(family)
    ids = prompts(2, 21, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    cfg = {**F64, **(config or {})}
    cached = hc.generate(exact, ids, attention_mask=mask, max_new_tokens=8, cache_config=cfg)
    oracle = hc.generate(exact, ids, attention_mask=mask, max_new_tokens=8, cache_config=cfg, use_cache=False)
    chunked = hc.generate(exact, ids, attention_mask=mask, max_new_tokens=8, cache_config=cfg, prefill_chunk_size=4)
    assert torch.equal(cached.sequences, oracle.sequences) and torch.equal(chunked.sequences, oracle.sequences)
    assert max_diff(cached.logits, oracle.logits) <= 1e-9
    assert max_diff(chunked.logits, oracle.logits) <= 1e-9


@pytest.mark.parametrize("family", FAMILIES)
def test_score_based_methods_that_keep_everything_equal_native(family, sink_models):
    """The eviction methods attend with weights (the sinks' share left out of them): keeping every token, they are
    exactly the native caches; compressing, they still run on the sink attention."""
    _, exact, _ = sink_models(family)
    ids = prompts(2, 24, seed=2)
    native = hc.generate(exact, ids, max_new_tokens=4, cache_config=F64)
    for name in ("snapkv", "knorm", "observed_attention", "expected_attention"):
        kw = {"window_size": 4} if name == "snapkv" else {}
        for ratio in (0.0, 0.5):
            out = hc.generate(
                exact,
                ids,
                max_new_tokens=4,
                cache_config={**F64, "full": {"type": name, "compression_ratio": ratio, **kw}},
            )
            if ratio == 0.0:
                assert torch.equal(out.sequences, native.sequences), name
                assert max_diff(out.logits, native.logits) < 1e-10, name
            assert torch.isfinite(out.logits).all(), name
    for name in ("tova", "h2o"):
        out = hc.generate(exact, ids, max_new_tokens=4, cache_config={**F64, "full": {"type": name, "budget": 99}})
        assert torch.equal(out.sequences, native.sequences), name
        assert max_diff(out.logits, native.logits) < 1e-10, name
