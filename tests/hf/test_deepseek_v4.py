"""DeepSeek-V4 through the bridge (hybridcache/hf/layers/compressed.py): its heavily compressed (HCA) and compressed
sparse (CSA) attention layers cache a sliding window plus, per compressor (CSA: its attention's and its indexer's),
pooled entries, the open window's sources and CSA's previous window; each is a group of ours, `attention` (sliding)
and one `compressed_kv` per compressor. Oracle: HF's own cache (DeepseekV4HCACache / CSACache) on the same tiny
random model built with HF's classes (tokens equal, logits within 1e-4 in float32), with prompts and generations
long enough that every compressor closes several windows (rates 4 and 8), the indexer picks 2 of its entries, and
the sliding window (8) slides; for crop, the same model fed without the cropped tokens."""

import pytest
import torch
from transformers import DynamicCache

from hybridcache.cache import CacheCropError
from hybridcache.hf import BridgeConfigError, cache_for
from tests.hf.conftest import hf_generate, max_diff, prompts

TOL = 1e-4
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}


@pytest.fixture(scope="module")
def model(hf_tiny):
    m = hf_tiny("deepseek_v4")
    assert m.config.compress_rates == RATES and m.config.sliding_window == 8 and m.config.index_topk == 2
    return m


def _own(model):
    return DynamicCache(config=model.config)


def test_each_compressed_layer_is_a_group_holding_hf_tensors(model):
    cache = cache_for(model)
    assert [(p.address, p.type) for p in cache.plan.layers] == [
        ("0", "sliding"),
        ("1.attention", "sliding"),
        ("1.compressor", "compressed_kv"),
        ("1.indexer", "compressed_kv"),
        ("2.attention", "sliding"),
        ("2.compressor", "compressed_kv"),
        ("3.attention", "sliding"),
        ("3.compressor", "compressed_kv"),
        ("3.indexer", "compressed_kv"),
    ]
    ids, mask = prompts(2, 23, seed=1, pad=3)
    own = _own(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
        model(input_ids=ids, attention_mask=mask, cache=own)
    for i in (1, 2, 3):
        hf = own.layers[i]
        for name in hf.compressed_kv:
            ours = cache.hybrid[i][name]
            assert torch.equal(ours.entries, hf.compressed_kv[name]) and ours.entry_count == hf.entry_count[name]
            assert torch.equal(ours.buffer_kv, hf.buffer_kv[name]) and torch.equal(
                ours.buffer_gate, hf.buffer_gate[name]
            )
            if ours.spec.overlap:
                assert torch.equal(ours.overlap_kv, hf.overlap_kv[name])
                assert torch.equal(ours.overlap_gate, hf.overlap_gate[name])
        assert torch.equal(cache.hybrid[i]["attention"].keys, hf.keys)
        bridged = cache.layers[i]  # HF's attribute names on the bridge's layer give the same tensors
        for attr in ("compressed_kv", "buffer_kv", "buffer_gate", "entry_count", "overlap_kv", "overlap_gate"):
            ours, theirs = getattr(bridged, attr, {}), getattr(hf, attr, {})
            assert ours.keys() == theirs.keys(), attr
            assert all(
                a == b if isinstance(a, int) else torch.equal(a, b) for a, b in zip(ours.values(), theirs.values())
            )
    assert cache.hybrid[3]["indexer"].entry_count == 5 and cache.hybrid[2]["compressor"].entry_count == 2


@pytest.mark.parametrize("pad", [0, 5])
def test_greedy_generate_equals_hf_own_cache(model, pad):
    ids, mask = prompts(2, 21, seed=2 + pad, pad=pad)
    seq, logits = hf_generate(model, ids, mask, cache=cache_for(model), new=14)
    ref_seq, ref_logits = hf_generate(model, ids, mask, cache=_own(model), new=14)
    assert torch.equal(seq, ref_seq)
    assert max_diff(logits, ref_logits) < TOL


def test_beam_search_equals_hf_own_cache(model):
    ids, mask = prompts(2, 13, seed=4, pad=2)
    seq, _ = hf_generate(model, ids, mask, cache=cache_for(model), new=10, num_beams=3)
    ref, _ = hf_generate(model, ids, mask, cache=_own(model), new=10, num_beams=3)
    assert torch.equal(seq, ref)


def test_continuation_from_a_returned_cache(model):
    ids, mask = prompts(2, 11, seed=9, pad=2)
    more = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(1))
    long_mask = torch.cat([mask, torch.ones(2, 9 + 6, dtype=mask.dtype)], 1)
    runs = []
    for cache in (cache_for(model), _own(model)):
        first, _ = hf_generate(model, ids, mask, cache=cache, new=9)
        runs.append(hf_generate(model, torch.cat([first, more], 1), long_mask, cache=cache, new=7))
    (seq, logits), (ref_seq, ref_logits) = runs
    assert torch.equal(seq, ref_seq) and max_diff(logits, ref_logits) < TOL


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


def test_plain_forwards_continued_across_calls_equal_hf_own_cache(model):
    ids, mask = prompts(2, 30, seed=8, pad=3)
    cuts = [3, 6, 7, 9, 10, 19, 20, 21, 29]  # blocks that close no window, one, several, single tokens
    got = _chunks(model, cache_for(model), ids, mask, cuts)
    ref = _chunks(model, _own(model), ids, mask, cuts)
    real = mask.bool()
    assert max_diff(got[real], ref[real]) < TOL


@torch.no_grad()
def test_crop_is_exact_within_the_open_windows_and_refused_before(model):
    """crop(-n) back into every compressor's open window continues as if the cropped tokens were never fed (the
    oracle: HF's own cache fed without them); further back it is a CacheCropError that changes nothing."""
    ids, mask = prompts(2, 29, seed=13, pad=2)  # 29 columns: CSA's open window starts at 28, HCA's at 24
    wrong = torch.randint(3, 300, (2, 2), generator=torch.Generator().manual_seed(2))
    right = torch.randint(3, 300, (2, 3), generator=torch.Generator().manual_seed(3))
    cache = cache_for(model, {"sliding": {"spare": 4}})  # the window keeps what the last 4 queries saw
    ones = torch.ones(2, 2, dtype=mask.dtype)
    model(input_ids=ids, attention_mask=mask, cache=cache)
    model(input_ids=wrong, attention_mask=torch.cat([mask, ones], 1), cache=cache)  # 31 columns
    snap = cache.hybrid.snapshot()
    with pytest.raises(CacheCropError, match="compressed_kv.*crop back to column 28"):
        cache.crop(-4)  # to 27: before CSA's open window
    assert cache.get_seq_length() == 31
    cache.crop(-2)
    assert cache.get_seq_length() == 29
    full = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    got = model(input_ids=right, attention_mask=full, cache=cache).logits
    own = _own(model)
    model(input_ids=ids, attention_mask=mask, cache=own)
    ref = model(input_ids=right, attention_mask=full, cache=own).logits
    assert max_diff(got, ref) < TOL
    cache.hybrid.restore(snap)  # (the refused crop left nothing behind: the snapshot is the state before it)
    assert cache.get_seq_length() == 31


def test_a_retyping_config_is_refused_by_name(model):
    for config in (
        {"attention": {"type": "full"}},
        {"sliding": {"window": 4}},
        {"layers": {2: {"attention": {"type": "snapkv", "compression_ratio": 0.5}}}},
    ):
        with pytest.raises(BridgeConfigError, match="compressed attention"):
            cache_for(model, config)
    cache_for(model, {"layers": {0: {"type": "sink", "sinks": 2, "window": 6}}})  # the plain sliding layer may change


def test_a_bad_compressor_call_is_refused_by_name(model):
    cache = cache_for(model, batch_size=1)
    layer = cache.layers[1]
    with pytest.raises(Exception, match="a forward"):
        layer.store_compression_weights("compressor", torch.zeros(1, 1, 32), torch.zeros(1, 1, 32))
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("bias", [torch.bfloat16, torch.float32])
def test_a_bfloat16_model_equals_hf_own_cache(hf_tiny, bias):
    """In bfloat16 the previous window's gate carries the position bias's dtype (float32 when HF loads a checkpoint,
    bfloat16 after `.to(bfloat16)`): the bridge reads it from the model and stores what HF stores, bit for bit."""
    model = hf_tiny("deepseek_v4").to(torch.bfloat16)
    for name, p in model.named_parameters():
        if name.endswith("position_bias"):
            p.data = p.data.to(bias)
    cache = cache_for(model)
    assert {p.spec.overlap_gate_dtype for p in cache.plan.layers if p.type == "compressed_kv"} == {bias}
    ids, mask = prompts(2, 21, seed=3, pad=4)
    seq, logits = hf_generate(model, ids, mask, cache=cache, new=12)
    ref_seq, ref_logits = hf_generate(model, ids, mask, cache=_own(model), new=12)
    assert torch.equal(seq, ref_seq) and torch.equal(logits, ref_logits)


def test_a_storage_that_keeps_hf_layout_serves_the_windows(model):
    """Storage whose slots stay HF's columns (offload: exact) is allowed on the compressed layers' windows."""
    cache = cache_for(model, {"attention": {"storage": "offload"}})
    assert {p.spec.storage for p in cache.plan.layers if p.kind == "attention"} == {"offload"}
    ids, mask = prompts(2, 19, seed=12, pad=3)
    seq, logits = hf_generate(model, ids, mask, cache=cache, new=10)
    ref_seq, ref_logits = hf_generate(model, ids, mask, cache=_own(model), new=10)
    assert torch.equal(seq, ref_seq) and max_diff(logits, ref_logits) < TOL
