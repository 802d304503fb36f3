"""MiniMax through the bridge (hybridcache/hf/own_cache.py): its model takes only its own MiniMaxCache, so the bridge
hands it a BridgeCache that is also one, with each lightning layer's state [B, H, D, D] in our `linear_attention`
type. Oracle: HF's own MiniMaxCache on the same tiny random model built with HF's classes (tokens equal, logits
within 1e-4 in float32), and for rollback a cache that never saw the cropped tokens."""

import pytest
import torch
from transformers.models.minimax.modeling_minimax import MiniMaxCache

from hybridcache.hf import BridgeError, cache_for
from tests.hf.conftest import hf_generate, max_diff, prompts

TOL = 1e-4
# block_size 4: prompts span several lightning blocks (HF's blockwise prefill); sliding_window: the attention layers'
# masks are HF's sliding ones over a cache that keeps every key
CONFIGS = {"default": {}, "blocks": {"block_size": 4}, "sliding": {"block_size": 4, "sliding_window": 5}}


@pytest.fixture(scope="module")
def models(hf_tiny):
    return {name: hf_tiny("minimax", **kw) for name, kw in CONFIGS.items()}


def test_the_cache_is_a_minimax_cache_with_linear_attention_layers(models):
    cache = cache_for(models["default"])
    assert isinstance(cache, MiniMaxCache)
    hf_types = models["default"].config.layer_types
    assert [p.type for p in cache.plan.layers] == [
        "full" if t == "full_attention" else "linear_attention" for t in hf_types
    ]
    assert not cache.is_croppable and cache_for(models["default"], {"recurrent": {"rollback": 2}}).is_croppable
    # with a sliding window HF masks its DynamicLayers to the window: our attention layers keep only that window
    sliding = [p for p in cache_for(models["sliding"]).plan.layers if p.kind == "attention"]
    assert {(p.type, p.spec.window) for p in sliding} == {("sliding", 5)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_left_padded_equals_hf_own_cache(models, name):
    model = models[name]
    ids, mask = prompts(3, 11, seed=5, pad=3)
    seq, logits = hf_generate(model, ids, mask, cache=cache_for(model), new=10)
    ref_seq, ref_logits = hf_generate(model, ids, mask, cache=MiniMaxCache(), new=10)
    assert torch.equal(seq, ref_seq)
    assert max_diff(logits, ref_logits) < TOL


@torch.no_grad()
def _chunks(model, cache, ids, mask, cuts):
    """Plain forwards over ids split at `cuts`, continued on one cache; the logits of every position [B, T, V]."""
    out, start = [], 0
    for end in [*cuts, ids.shape[1]]:
        pos = (mask[:, :end].cumsum(1) - 1).clamp(min=0)[:, start:end]
        res = model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=pos, cache=cache)
        out.append(res.logits)
        start = end
    return torch.cat(out, 1)


@pytest.mark.parametrize("name", ["blocks", "sliding"])
def test_plain_forwards_continued_across_calls_equal_hf_own_cache(models, name):
    model = models[name]
    ids, mask = prompts(2, 14, seed=8, pad=2)
    cuts = [6, 7, 8, 12]  # a multi-block prefill, single tokens, then a multi-token chunk (HF's per-token path)
    got = _chunks(model, cache_for(model), ids, mask, cuts)
    ref = _chunks(model, MiniMaxCache(), ids, mask, cuts)
    real = mask.bool()
    assert max_diff(got[real], ref[real]) < TOL


def test_beam_search_and_sampling_equal_hf_own_cache(models):
    model = models["blocks"]
    ids, mask = prompts(2, 9, seed=3, pad=1)
    for kw in (dict(num_beams=3), dict(do_sample=True, top_k=5)):
        torch.manual_seed(0)
        seq, _ = hf_generate(model, ids, mask, cache=cache_for(model), new=6, **kw)
        torch.manual_seed(0)
        ref, _ = hf_generate(model, ids, mask, cache=MiniMaxCache(), new=6, **kw)
        assert torch.equal(seq, ref), kw


@torch.no_grad()
def _decode(model, cache, mask, tokens):
    out = []
    for t in tokens.unbind(1):
        mask = torch.cat([mask, torch.ones_like(t[:, None])], 1)
        pos = (mask.sum(1, keepdim=True) - 1).clamp(min=0)
        out.append(model(input_ids=t[:, None], attention_mask=mask, position_ids=pos, cache=cache).logits[:, -1])
    return torch.stack(out, 1), mask


def test_crop_rewinds_lightning_states_by_checkpoints(models):
    """HF's MiniMaxCache refuses crop; ours rewinds from its trail, as if the cropped tokens were never fed."""
    model = models["blocks"]
    ids, mask = prompts(2, 9, seed=13, pad=2)
    wrong = torch.randint(3, 300, (2, 3), generator=torch.Generator().manual_seed(2))
    right = torch.randint(3, 300, (2, 4), generator=torch.Generator().manual_seed(3))
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = cache_for(model, {"recurrent": {"rollback": 4}})
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache)
    _decode(model, cache, mask, wrong)
    cache.crop(-3)
    assert cache.get_seq_length() == ids.shape[1]
    got, _ = _decode(model, cache, mask, right)
    ref = MiniMaxCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=ref)
    expected, _ = _decode(model, ref, mask, right)
    assert max_diff(got, expected) < TOL
    with pytest.raises(RuntimeError):
        ref.crop(-1)  # HF's own cannot


def test_crop_without_rollback_is_refused_by_name(models):
    model = models["default"]
    ids, mask = prompts(1, 5, seed=1)
    cache = cache_for(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
    with pytest.raises(Exception, match="rollback"):
        cache.crop(-1)
    assert cache.get_seq_length() == 5


def test_a_linear_cache_call_on_an_attention_layer_is_refused(models):
    cache = cache_for(models["default"], batch_size=1)
    with pytest.raises(BridgeError, match="not a lightning"):
        cache.get_linear_cache(0)


def test_a_malformed_linear_state_is_refused_by_name(models):
    cache = cache_for(models["default"], batch_size=1)
    with pytest.raises(BridgeError, match="linear-attention state must be"):
        cache.set_linear_cache(1, torch.zeros(1, 2))
    with pytest.raises(BridgeError, match="linear-attention state must be"):
        cache.set_linear_cache(1, [])
    assert cache.get_seq_length() == 0


class _RoundedMiniMaxCache(MiniMaxCache):
    """HF's own cache whose lightning states are rounded to bfloat16 when stored (torch's cast, the oracle)."""

    def set_linear_cache(self, layer_idx, linear_cache):
        super().set_linear_cache(layer_idx, linear_cache.to(torch.bfloat16).to(linear_cache.dtype))


@torch.no_grad()
def test_a_state_codec_applies_to_the_lightning_states(models):
    """state_codec bfloat16 on our linear_attention layers == HF's own cache storing its states cast to bfloat16
    after each forward (our layers encode once per block: one forward each, as HF's cache stores)."""
    model = models["blocks"]
    ids, mask = prompts(2, 10, seed=4, pad=2)
    cuts = [6, 7, 8]
    got = _chunks(model, cache_for(model, {"recurrent": {"state_codec": "bfloat16"}}), ids, mask, cuts)
    ref = _chunks(model, _RoundedMiniMaxCache(), ids, mask, cuts)
    exact = _chunks(model, MiniMaxCache(), ids, mask, cuts)
    real = mask.bool()
    assert max_diff(got[real], ref[real]) < TOL
    assert max_diff(got[real], exact[real]) > 10 * TOL  # the rounding shows: the codec really holds the states
