"""(c) Lossy cache types through the bridge equal hybridcache's own model path on the same family and config (both
loaded from the same saved tiny checkpoint): every press (the same kept positions per layer, row and head; the same
tokens; logits within float32 noise), every quantized KV storage and every state codec (the same tokens, logits
within float32 noise). The two paths share only the cache types: HF's modeling code and kernels on one side, ours on
the other."""

import pytest
import torch

import hybridcache as hc
from hybridcache.hf import BridgeError, cache_for
from tests.hf.conftest import NEW, hf_generate, max_diff, prompts

TOL = 2e-4  # two float32 implementations of the same model (HF's and ours): what they differ by natively
# A coarse codec turns that noise into a whole quantization step wherever a value sits at a rounding boundary; a wrong
# layout or scale axis would differ by about the codec's whole effect, so those compare against a share of it
SHARE_OF_EFFECT = 0.02

PRESSES = {
    "knorm": {"type": "knorm", "compression_ratio": 0.5},
    "snapkv": {"type": "snapkv", "compression_ratio": 0.5, "window_size": 3, "kernel_size": 3},
    "pyramidkv": {"type": "pyramidkv", "compression_ratio": 0.5, "window_size": 3, "kernel_size": 3},
    "streaming_llm": {"type": "streaming_llm", "budget": 5, "n_sink": 2},
    "tova": {"type": "tova", "budget": 6},
    "observed_attention": {"type": "observed_attention", "compression_ratio": 0.5},
    "h2o": {"type": "h2o", "budget": 6},
    "expected_attention": {
        "type": "expected_attention",
        "compression_ratio": 0.5,
        "n_sink": 1,
        "n_future_positions": 8,
    },
}
STORAGES = {
    "int8": {"storage": "int8"},
    "int4": {"storage": "int4", "q_group_size": 16},
    "int4_residual": {"storage": "int4", "q_group_size": 16, "residual": 3},
    "kivi": {"storage": "kivi", "nbits": 2, "q_group_size": 16, "residual": 16},
    "hf_quantized": {"storage": "hf_quantized", "nbits": 4, "q_group_size": 16, "residual": 4},
}
CODECS = {
    "bfloat16": {"state_codec": "bfloat16"},
    "float8_e4m3fn": {"state_codec": "float8_e4m3fn"},
    "int8": {"state_codec": "int8"},
    "int4_heads_conv": {"state_codec": "int4", "state_group": "head", "quantize_conv": True},
    "zero": {"state_codec": "zero", "quantize_conv": True},
}


def _both(pair, family, config, pad=2, share=0.0):
    """Generate with the bridge and with our model under `config`: the same tokens, logits within TOL (or within
    `share` of the config's own effect on our model, if larger). Returns both caches."""
    hf, ours = pair(family)
    ids, mask = prompts(2, 9, seed=3, pad=pad)
    cache = cache_for(hf, config)
    seq, logits = hf_generate(hf, ids, mask, cache=cache)
    mine = hc.generate(ours, ids, mask, NEW, cache_config=config, output_logits=True)
    assert torch.equal(seq[:, ids.shape[1] :], mine.sequences[:, ids.shape[1] :]), f"{family} {config}: tokens"
    tol = TOL
    if share:
        native = hc.generate(ours, ids, mask, NEW, output_logits=True)
        tol = max(TOL, share * max_diff(mine.logits, native.logits))
    assert max_diff(logits, mine.logits) < tol, f"{family} {config}"
    return cache.hybrid, mine.cache


# knorm ranks keys by their norm; Gemma 3 and Llama 4 normalize their keys (k_norm / qk L2 norm), so that ranking is
# decided by float noise: knorm runs on families without a key norm
PRESS_FAMILIES = {press: ["jamba", "bamba"] if press == "knorm" else ["jamba", "gemma3"] for press in PRESSES}
# expected_attention reads the pre-rotary queries from HF's modules (hybridcache/hf/queries.py): no rotary (Jamba),
# one rotary table per layer type after a q-norm (Gemma 3), a partial rotary after a gated query's norm (Qwen3-Next)
PRESS_FAMILIES["expected_attention"] = ["jamba", "gemma3", "qwen3_next"]


@pytest.mark.parametrize(("press", "family"), [(p, f) for p, fams in PRESS_FAMILIES.items() for f in fams])
def test_press_keeps_what_our_model_keeps(pair, family, press):
    bridged, ours = _both(pair, family, {"attention": PRESSES[press]})
    assert [p.type for p in bridged.plan.layers] == [p.type for p in ours.plan.layers]
    evicted = False
    for a, b in zip(bridged.layers, ours.layers):
        if a.kind == "attention":
            assert torch.equal(a.key_positions(), b.key_positions()), f"{press}: kept positions differ"
            held = (a.key_positions() >= 0).sum(-1)  # [B] or [B, H]: real tokens each row (and head) holds
            evicted |= bool((held.view(held.shape[0], -1).amax(-1) < bridged.seen).any())
    assert evicted, f"{press} evicted nothing: the test would not see a wrong eviction"


def test_expected_attention_without_a_query_projection_is_refused_by_name(hf_tiny):
    """Phi-3 projects q, k and v in one matrix: the pre-rotary queries cannot be read from its modules, which is a
    named error at its first forward, not a silent approximation."""
    hf = hf_tiny("phi3")
    ids, mask = prompts(1, 9, seed=3)
    cache = cache_for(hf, {"attention": {"type": "expected_attention", "compression_ratio": 0.5}})
    with pytest.raises(BridgeError, match="pre-rotary queries"):
        hf_generate(hf, ids, mask, cache=cache)
    assert cache.columns == 0  # the failed forward changed nothing


@pytest.mark.parametrize("family", ["gemma3", "qwen3_next"])
@pytest.mark.parametrize("storage", list(STORAGES))
def test_quantized_storage_equals_our_model(pair, family, storage):
    _both(pair, family, {"attention": STORAGES[storage]}, share=SHARE_OF_EFFECT)


@pytest.mark.parametrize("family", ["jamba", "bamba", "qwen3_next", "lfm2"])
@pytest.mark.parametrize("codec", list(CODECS))
def test_state_codec_equals_our_model(pair, family, codec):
    config = CODECS[codec]
    bridged, _ = _both(pair, family, {"recurrent": config}, share=SHARE_OF_EFFECT)
    lossy = family != "lfm2" or config.get("quantize_conv")  # lfm2 holds only conv states: dense unless asked
    assert bridged.is_exact != bool(lossy)
