"""The generation loop: clear errors, eos per row, seeded sampling, top-k / top-p (on the tiny Gemma3)."""

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import CacheConfigError
from hybridcache.generation.loop import sample_next
from tests.models.conftest import prompts


@pytest.fixture(scope="module")
def model(models):
    return models("gemma3")[0]


def test_bad_requests_fail_clearly(model):
    ids = prompts(2, 6, seed=0)
    cases = [
        (lambda: hc.generate(model, ids[:, :0]), "empty"),
        (lambda: hc.generate(model, ids.float()), "LongTensor"),
        (lambda: hc.generate(model, ids, max_new_tokens=0), "max_new_tokens"),
        (lambda: hc.generate(model, ids, attention_mask=torch.ones(3, 6)), "3 rows"),
        (lambda: hc.generate(model, ids, attention_mask=torch.ones(2, 4, dtype=torch.long)), "must match input_ids"),
        (lambda: hc.generate(model, ids, attention_mask=torch.full((2, 6), 0.5)), "bool or an integer"),
        (lambda: hc.generate(model, ids, attention_mask=torch.full((2, 6), 2)), "only 0 and 1"),
        (lambda: hc.generate(model, ids, attention_mask=torch.full((2, 6), -1)), "only 0 and 1"),
        (lambda: hc.generate(model, ids, prefill_chunk_size=True), "prefill_chunk_size"),
        (lambda: hc.generate(model, ids, temperature=0), "temperature"),  # greedy too: a bad value is a bug
        (lambda: hc.generate(model, ids, top_k=0), "top_k"),
        (lambda: hc.generate(model, ids, seed=1.5), "seed"),
        (lambda: hc.generate(model, ids, attention_mask=torch.tensor([[1] * 6, [0] * 6])), "at least one real token"),
        (lambda: hc.generate(model, ids, attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1]] * 2)), "left padding"),
        (lambda: hc.generate(model, ids, cache=model.make_cache(3)), "batch size 3"),
        (lambda: hc.generate(model, ids, cache=model.make_cache(2, max_length=10), max_new_tokens=8), "max_length=10"),
        (lambda: hc.generate(model, ids, cache=model.make_cache(2), cache_config={}), "not both"),
        (lambda: hc.generate(model, ids, cache=model.make_cache(2), use_cache=False), "cannot continue"),
        (lambda: hc.generate(model, ids, do_sample=True, temperature=0), "temperature"),
        (lambda: hc.generate(model, ids, do_sample=True, top_p=1.5), "top_p"),
        (lambda: hc.generate(model, ids, prefill_chunk_size=0), "prefill_chunk_size"),
        (lambda: hc.generate(model, torch.full((1, 3), 999)), "outside the vocabulary"),
        (lambda: hc.generate(model, ids, temperature=float("inf")), "finite number"),
        (lambda: hc.generate(model, ids, do_sample="yes"), "do_sample must be True or False"),
        (lambda: hc.generate(model, ids, use_cache=0), "use_cache must be True or False"),
        (lambda: hc.generate(model, ids, eos_token_id=1.5), "eos_token_id"),
        (lambda: hc.generate(model, ids, eos_token_id="</s>"), "eos_token_id"),
        (lambda: hc.generate(model, ids, eos_token_id=[1, 10**9]), "eos_token_id"),
        (lambda: hc.generate(model, ids, eos_token_id=-1), "eos_token_id"),
        (lambda: hc.generate(model, ids, output_logits=None), "output_logits must be True or False"),
        (lambda: hc.generate(model, ids, decode_runs=1), "decode_runs must be True or False"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_cache_config_that_does_not_fit_the_model(model):
    ids = prompts(1, 4, seed=0)
    with pytest.raises(CacheConfigError, match="layer index out of range"):
        hc.generate(model, ids, cache_config={"layers": {9: {"type": "full"}}})
    with pytest.raises(CacheConfigError, match="cannot use the recurrent cache type 'mamba'"):
        hc.generate(model, ids, cache_config={"attention": {"type": "mamba"}})


def test_a_failed_forward_leaves_the_cache_unchanged(model):
    cache = model.make_cache(1)
    hc.generate(model, prompts(1, 5, seed=0), max_new_tokens=2, cache=cache)
    before = cache.snapshot()
    with pytest.raises(ValueError):
        model(prompts(1, 3, seed=1), cache, attention_mask=torch.tensor([[1, 0, 1]]))
    after = cache.snapshot()
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for a, b in zip(before.layers, after.layers) for n in a.tensors)


def test_eos_stops_each_row_and_pads_it(model):
    ids = prompts(2, 8, seed=7)
    free = hc.generate(model, ids, max_new_tokens=10)
    eos = int(free.sequences[0, 8 + 2])  # row 0's third new token
    out = hc.generate(model, ids, max_new_tokens=10, eos_token_id=eos)
    row0 = out.sequences[0, 8:].tolist()
    stop = row0.index(eos)
    assert stop <= 2 and all(t == model.config["pad_token_id"] for t in row0[stop + 1 :])
    row1 = free.sequences[1, 8:].tolist()
    expected_row1 = row1[: row1.index(eos) + 1] if eos in row1 else row1
    assert out.sequences[1, 8 : 8 + len(expected_row1)].tolist() == expected_row1[: out.sequences.shape[1] - 8]


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    ids = prompts(2, 6, seed=3)
    a = hc.generate(model, ids, max_new_tokens=12, do_sample=True, seed=1, temperature=1.5)
    b = hc.generate(model, ids, max_new_tokens=12, do_sample=True, seed=1, temperature=1.5)
    c = hc.generate(model, ids, max_new_tokens=12, do_sample=True, seed=2, temperature=1.5)
    assert torch.equal(a.sequences, b.sequences) and not torch.equal(a.sequences, c.sequences)
    greedy = hc.generate(model, ids, max_new_tokens=12)
    top1 = hc.generate(model, ids, max_new_tokens=12, do_sample=True, seed=1, top_k=1)
    assert torch.equal(top1.sequences, greedy.sequences)
    tiny_p = hc.generate(model, ids, max_new_tokens=12, do_sample=True, seed=1, top_p=1e-6)
    assert torch.equal(tiny_p.sequences, greedy.sequences)


def test_top_k_and_top_p_filter_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, 2, None, g)) for _ in range(300)}
    assert draws == {0, 1}  # top-2
    draws = {int(sample_next(logits, 1.0, None, 0.7, g)) for _ in range(300)}
    assert draws == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    draws = {int(sample_next(logits, 1.0, None, 0.81, g)) for _ in range(300)}
    assert draws == {0, 1, 2}


# -- continuation: the whole sequence, checked against what the cache saw, also after crop / restore / row ops ----
def test_a_cropped_cache_still_knows_its_tokens(model):
    ids = prompts(2, 7, seed=3)
    out = hc.generate(model, ids, max_new_tokens=4, cache_config={"attention": {"type": "full"}})
    cache = out.cache
    cache.crop(9)  # the prompt and two generated tokens
    kept = out.sequences[:, :9]
    with pytest.raises(ValueError, match="not the tokens the cache saw"):  # only new tokens, longer than 9
        hc.generate(model, prompts(2, 12, seed=4), max_new_tokens=2, cache=cache)
    with pytest.raises(ValueError, match="not the tokens the cache saw"):  # a different first part
        hc.generate(model, torch.cat([kept.flip(1), kept[:, :1]], 1), max_new_tokens=2, cache=cache)
    more = torch.cat([kept, prompts(2, 3, seed=5)], 1)
    got = hc.generate(model, more, max_new_tokens=3, cache=cache)
    want = hc.generate(model, more, max_new_tokens=3, cache_config={"attention": {"type": "full"}})
    assert torch.equal(got.sequences, want.sequences)
    cache.crop(0)  # nothing kept: any sequence is a valid continuation
    assert torch.equal(hc.generate(model, more, max_new_tokens=3, cache=cache).sequences, want.sequences)


def test_row_operations_and_restore_keep_what_each_row_saw(model):
    ids = prompts(2, 6, seed=6)
    out = hc.generate(model, ids, max_new_tokens=3, cache_config={"attention": {"type": "full"}})
    cache, seq = out.cache, out.sequences
    snap = cache.snapshot()
    cache.reorder([1, 0])
    cache.crop(7)
    with pytest.raises(ValueError, match="not the tokens the cache saw"):
        hc.generate(model, torch.cat([seq[:, :7], seq[:, :1]], 1), max_new_tokens=1, cache=cache)
    flipped = seq.flip(0)
    hc.generate(model, torch.cat([flipped[:, :7], flipped[:, 7:8]], 1), max_new_tokens=1, cache=cache)
    cache.restore(snap)  # back to both rows as generated, token history included
    cache.crop(6)
    hc.generate(model, seq[:, :7], max_new_tokens=1, cache=cache)
    cache.select([1])
    with pytest.raises(ValueError, match="not the tokens the cache saw"):
        hc.generate(model, seq[:1, :8], max_new_tokens=1, cache=cache)
    hc.generate(model, seq[1:, :8], max_new_tokens=1, cache=cache)


def test_a_cache_fed_without_token_ids_cannot_be_continued_by_generate(model):
    cache = model.make_cache(1)
    with cache.block(None, 2):  # fed by hand: the cache never learns the token ids
        for layer in cache.layers:
            s = layer.spec
            layer.update(torch.randn(1, s.num_kv_heads, 2, s.head_dim), torch.randn(1, s.num_kv_heads, 2, s.head_dim))
    with pytest.raises(ValueError, match="does not know which tokens it saw"):
        hc.generate(model, prompts(1, 5, seed=7), max_new_tokens=1, cache=cache)
    model(prompts(1, 1, seed=8), cache)  # the model itself can still feed it


def test_a_continuation_mask_must_count_the_cached_tokens_as_the_cache_did(model):
    # the cache saw 5 real tokens in row 0 and 3 in row 1 (left padding); a whole-sequence mask that marks another
    # count of the cached columns as real is refused, by generate and by a direct model call alike
    ids, mask = prompts(2, 5, seed=10), torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    out = hc.generate(model, ids, mask, max_new_tokens=2)
    seq = torch.cat([out.sequences, prompts(2, 1, seed=11)], dim=1)
    bad = torch.ones_like(seq)
    with pytest.raises(ValueError, match="row 1 marks 6 of the 6 cached columns as real, but the cache saw 4"):
        hc.generate(model, seq, bad, max_new_tokens=1, cache=out.cache)
    with pytest.raises(ValueError, match="row 1 marks 6 of the 6 cached columns as real, but the cache saw 4"):
        model(seq[:, 6:], out.cache, bad)  # the model: new tokens, the mask over the whole sequence
    good = torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], dim=1)
    hc.generate(
        model, seq, torch.cat([good, torch.ones(2, 1, dtype=torch.long)], dim=1), max_new_tokens=1, cache=out.cache
    )


def test_a_cache_can_be_copied(model):
    import copy

    out = hc.generate(model, prompts(1, 5, seed=9), max_new_tokens=2)
    twin = copy.deepcopy(out.cache)
    a = hc.generate(model, torch.cat([out.sequences, prompts(1, 2, seed=10)], 1), max_new_tokens=2, cache=out.cache)
    b = hc.generate(model, torch.cat([out.sequences, prompts(1, 2, seed=10)], 1), max_new_tokens=2, cache=twin)
    assert torch.equal(a.logits, b.logits)


def test_output_logits_false_keeps_only_the_tokens(model):
    """The same tokens and the same cache, without the [B, T_new, V] logits (greedy, sampled, continued)."""
    ids = prompts(2, 7, seed=3)
    for kwargs in ({}, {"do_sample": True, "seed": 5, "top_k": 20}):
        full = hc.generate(model, ids, max_new_tokens=6, **kwargs)
        lean = hc.generate(model, ids, max_new_tokens=6, output_logits=False, **kwargs)
        assert lean.logits is None and torch.equal(full.sequences, lean.sequences)
        more = hc.generate(model, lean.sequences, cache=lean.cache, max_new_tokens=3, output_logits=False)
        again = hc.generate(model, full.sequences, cache=full.cache, max_new_tokens=3)
        assert more.logits is None and torch.equal(more.sequences, again.sequences)
