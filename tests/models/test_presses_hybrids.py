"""The score-based methods on the attention layers of hybrid families: compression after the prompt leaves the
recurrent states of the prompt as they were, and a method that keeps everything is exactly the native strategy."""

import pytest
import torch

import hybridcache as hc
from tests.models.conftest import prompts


@pytest.mark.parametrize("family", ["jamba", "zamba2", "falcon_h1", "qwen3_next", "gemma3", "llama4"])
def test_every_method_runs_on_the_attention_layers_of_hybrids(models, family):
    """Recurrent layers untouched; a ratio-0 / huge-budget method is exactly the native strategy."""
    model, _ = models(family, torch.float64)
    ids = prompts(2, 24, seed=2)
    states = {"recurrent": {"state_dtype": torch.float64}}
    native = hc.generate(model, ids, max_new_tokens=4, cache_config=states)
    prefilled = hc.generate(model, ids, max_new_tokens=1, cache_config=states)
    for name in ("snapkv", "knorm", "streaming_llm", "observed_attention", "expected_attention", "pyramidkv"):
        kw = {"window_size": 4} if name in ("snapkv", "pyramidkv") else {}
        out = hc.generate(
            model,
            ids,
            max_new_tokens=4,
            cache_config={**states, "full": {"type": name, "compression_ratio": 0.0, **kw}},
        )
        assert torch.equal(out.sequences, native.sequences), name
        assert (out.logits - native.logits).abs().max() < 1e-10, name
        lossy = hc.generate(
            model,
            ids,
            max_new_tokens=4,
            cache_config={**states, "full": {"type": name, "compression_ratio": 0.5, **kw}},
        )
        assert torch.isfinite(lossy.logits).all()
        prompt_only = hc.generate(
            model,
            ids,
            max_new_tokens=1,
            cache_config={**states, "full": {"type": name, "compression_ratio": 0.5, **kw}},
        )
        for entry_n, entry_l in zip(prefilled.cache.layers, prompt_only.cache.layers):
            if entry_n.kind == "recurrent":  # compression happens after the prompt: its states are the native ones
                for s in entry_n.states:  # (up to float64 rounding: attention with weights takes the explicit path)
                    assert (entry_n.states[s] - entry_l.states[s]).abs().max() < 1e-12, (name, s)
    for name in ("tova", "h2o"):
        out = hc.generate(model, ids, max_new_tokens=4, cache_config={**states, "full": {"type": name, "budget": 99}})
        assert torch.equal(out.sequences, native.sequences), name


@pytest.mark.parametrize(
    "config",
    [
        {"attention": {"type": "snapkv", "compression_ratio": 0.5, "window_size": 4}},
        {"attention": {"type": "h2o", "budget": 8}},
        {"attention": {"type": "tova", "compression_ratio": 0.5, "schedule": "prefill"}},
    ],
)
def test_save_load_continues_bit_exactly(models, tmp_path, config):
    """Per-head positions, the prompt length and H2O's accumulated attention travel with a saved cache."""
    from hybridcache.cache import Cache

    model, _ = models("jamba")
    ids = prompts(2, 30, seed=5)
    out = hc.generate(model, ids, max_new_tokens=4, cache_config=config)
    out.cache.save(tmp_path / "c.safetensors")
    loaded = Cache.load(tmp_path / "c.safetensors", model, cache_config=config)
    more = torch.cat([out.sequences, ids[:, :3]], 1)
    a = hc.generate(model, more, max_new_tokens=3, cache=out.cache)
    b = hc.generate(model, more, max_new_tokens=3, cache=loaded)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.logits, b.logits)


def test_prefill_schedule_refuses_a_chunked_prefill(models):
    model, _ = models("jamba")
    with pytest.raises(ValueError, match="one block"):
        hc.generate(
            model,
            prompts(1, 30, seed=1),
            max_new_tokens=2,
            prefill_chunk_size=8,
            cache_config={"attention": {"type": "knorm", "compression_ratio": 0.5}},
        )
