"""The bridge in every way HF runs a model: plain forwards continued across calls (a third-party loop), greedy,
sampling, beam search, left-padded batches, continuation from a returned cache, HF's batch operations. Each against
HF's own cache on the same model and inputs (tokens equal, logits within 1e-4 in float32)."""

import pytest
import torch
from transformers import DynamicCache

from hybridcache.hf import cache_for
from tests.hf.conftest import hf_generate, hf_kwargs, max_diff, prompts

TOL = 1e-4
FAMILIES = ["gemma3", "jamba", "qwen3_next", "falcon_h1"]  # sliding + full, mamba, gated delta, parallel groups


def _own(hf):
    return DynamicCache(config=hf.config.get_text_config(decoder=True))


@torch.no_grad()
def _loop(model, cache, ids, mask, new):
    """A third-party greedy loop holding the cache across calls: a prefill, then one token per forward, passing
    HF's 2-D attention mask (every column seen) each time."""
    out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    seq, logits = ids, [out.logits[:, -1]]
    for _ in range(new - 1):
        nxt = logits[-1].argmax(-1, keepdim=True)
        seq, mask = torch.cat([seq, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
        out = model(input_ids=nxt, attention_mask=mask, cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return seq, torch.stack(logits, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_third_party_loop_equals_hf_own_cache(pair, family):
    hf, _ = pair(family)
    ids, mask = prompts(2, 7, seed=5, pad=2)
    seq, logits = _loop(hf, cache_for(hf), ids, mask, 6)
    ref_seq, ref_logits = _loop(hf, _own(hf), ids, mask, 6)
    assert torch.equal(seq, ref_seq) and max_diff(logits, ref_logits) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_split_over_forwards(pair, family):
    """A prompt fed in three forwards (plain calls; blocks of 4, 1 and 4 tokens) gives what HF's own cache gives for
    the same calls, and the logits of one forward where HF's modeling code continues a multi-token block from a state
    (HF's Jamba and Bamba torch paths restart the scan of a multi-token block after the first: measured 0.1 and 1.0
    in logits with HF's own cache; the bridge reproduces that, it does not change HF's mixers)."""
    hf, _ = pair(family)
    ids, _ = prompts(2, 9, seed=6)
    cache = cache_for(hf)
    with torch.no_grad():
        parts = torch.cat([hf(input_ids=ids[:, a:b], cache=cache).logits for a, b in ((0, 4), (4, 5), (5, 9))], 1)
        own = _own(hf)
        ref = torch.cat([hf(input_ids=ids[:, a:b], cache=own).logits for a, b in ((0, 4), (4, 5), (5, 9))], 1)
        whole = hf(input_ids=ids, cache=cache_for(hf)).logits
    assert max_diff(parts, ref) < TOL
    if family not in ("jamba", "bamba"):
        assert max_diff(parts, whole) < TOL
    assert cache.hybrid.columns == 9 and cache.get_seq_length() == 9


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_equals_hf_own_cache(pair, family):
    hf, _ = pair(family)
    ids, mask = prompts(2, 7, seed=7, pad=1)
    torch.manual_seed(11)
    seq, _ = hf_generate(hf, ids, mask, cache=cache_for(hf), do_sample=True, top_k=20, temperature=0.8)
    torch.manual_seed(11)
    ref, _ = hf_generate(hf, ids, mask, cache=_own(hf), do_sample=True, top_k=20, temperature=0.8)
    assert torch.equal(seq, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_equals_hf_own_cache(pair, family):
    """Beams move with HF's reorder_cache, our cache's reorder (one transaction over every layer)."""
    hf, _ = pair(family)
    ids, mask = prompts(2, 7, seed=8, pad=2)
    kw = hf_kwargs(6, num_beams=3, num_return_sequences=2, output_scores=True)
    kw.pop("output_logits")
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, cache=cache_for(hf), **kw)
        ref = hf.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_diff(out.sequences_scores, ref.sequences_scores) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_continuation_from_a_returned_cache(pair, family):
    """generate, then generate again on the whole sequence plus new tokens with the returned cache (HF slices the
    input by the cache's length): as HF's own cache through the same two calls, and as one generation over the whole
    prompt where HF's modeling code continues multi-token blocks (not Jamba / Bamba, see above)."""
    hf, _ = pair(family)
    ids, mask = prompts(2, 7, seed=9, pad=2)
    more = torch.randint(3, 300, (2, 3), generator=torch.Generator().manual_seed(1))
    long_mask = torch.cat([mask, torch.ones(2, 7, dtype=mask.dtype)], 1)
    runs = []
    for cache in (cache_for(hf), _own(hf)):
        first, _ = hf_generate(hf, ids, mask, cache=cache, new=4)
        runs.append(hf_generate(hf, torch.cat([first, more], 1), long_mask, cache=cache, new=5))
    (seq, logits), (ref_seq, ref_logits) = runs
    assert torch.equal(seq, ref_seq) and max_diff(logits, ref_logits) < TOL
    if family not in ("jamba", "bamba"):
        fresh_seq, fresh_logits = hf_generate(hf, seq[:, :-5], long_mask, new=5)
        assert torch.equal(seq, fresh_seq) and max_diff(logits, fresh_logits) < TOL


@pytest.mark.parametrize("family", ["gemma3", "jamba"])
def test_batch_operations(pair, family):
    """batch_repeat_interleave, batch_select_indices and reorder_cache on a filled cache (one transaction each over
    every layer), then a decode step: as a fresh prefill of the rows they picked (HF's own linear-attention layers
    have no batch_repeat_interleave to compare with)."""
    hf, _ = pair(family)
    ids, mask = prompts(2, 7, seed=10, pad=2)
    cache = cache_for(hf)
    nxt = torch.tensor([[5], [6], [7]])
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=mask, cache=cache)
        cache.batch_repeat_interleave(2)  # rows [0, 0, 1, 1]
        cache.batch_select_indices(torch.tensor([3, 0, 2]))  # [1, 0, 1]
        cache.reorder_cache(torch.tensor([1, 2, 0]))  # [0, 1, 1]
        rows = torch.tensor([0, 1, 1])
        m2 = torch.cat([mask[rows], torch.ones(3, 1, dtype=mask.dtype)], 1)
        a = hf(input_ids=nxt, attention_mask=m2, cache=cache).logits
        fresh = hf(input_ids=torch.cat([ids[rows], nxt], 1), attention_mask=m2, cache=_own(hf)).logits[:, -1:]
    assert max_diff(a, fresh) < TOL and cache.batch_size == 3


def test_a_forward_that_raises_changes_nothing(pair):
    """A forward is one transaction: an exception in a late layer leaves every layer as before (HF's own cache
    would keep the earlier layers' writes)."""
    hf, _ = pair("jamba")
    ids, mask = prompts(2, 7, seed=12, pad=2)
    cache = cache_for(hf)
    seq, _ = hf_generate(hf, ids, mask, cache=cache, new=3)
    snap = cache.hybrid.snapshot()

    def boom(*_):
        raise RuntimeError("boom")

    handle = hf.model.layers[-1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            hf(input_ids=seq[:, -1:], attention_mask=torch.ones_like(seq), cache=cache)
    finally:
        handle.remove()
    after = cache.hybrid.snapshot()
    assert after.columns == snap.columns and torch.equal(after.seen, snap.seen)
    for x, y in zip(after.layers, snap.layers):
        assert all(torch.equal(x.tensors[k], y.tensors[k]) for k in x.tensors)
