"""Cache.save / load / continue after every way a cache is fed, on every family, for one row and for several.

A batch-1 cache whose last block had more than one token (a prefill, a chunked prefill, a greedy decode run) holds
its fingerprint as a view with a non-unit stride ([1] with stride [T]); saving it failed in the payload hash. Each
case here saves the cache its feed left, loads it back, checks the round trip bit for bit, and feeds the same new
tokens to the original and the loaded cache: equal logits, and (the oracle) equal to the whole sequence recomputed
without a cache.
"""

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import Cache
from hybridcache.checkpoints.tiny import FAMILIES
from hybridcache.generation.sources.beam import beam_search
from hybridcache.generation.sources.speculative import EarlyExitDraft
from tests.models.conftest import prompts

FEEDS = ("prefill", "chunked_prefill", "decode_run", "steps", "speculative", "beam")


def _fill(model, feed: str, batch: int):
    """(cache, the tokens it saw [rows, T] or None when rows are beams) after feeding a prompt the way `feed` says."""
    ids = prompts(batch, 9, seed=batch)
    if feed == "prefill":  # one block of 9 tokens, nothing after it
        cache = model.make_cache(batch)
        model(ids, cache)
        return cache, ids
    if feed == "beam":
        return beam_search(model, ids, num_beams=2, max_new_tokens=3).cache, None
    settings = {
        "chunked_prefill": {"max_new_tokens": 1, "prefill_chunk_size": 4},
        "decode_run": {"max_new_tokens": 7},  # greedy decode runs where the family has them
        "steps": {"max_new_tokens": 4, "decode_runs": False},
        "speculative": {"max_new_tokens": 6, "draft_model": EarlyExitDraft(model, 1), "num_draft_tokens": 3},
    }[feed]
    out = hc.generate(model, ids, **settings)
    return out.cache, out.sequences[:, : out.cache.columns]


def _same(a: Cache, b: Cache) -> bool:
    sa, sb = a.snapshot(), b.snapshot()
    return (
        sa.columns == sb.columns
        and torch.equal(sa.seen, sb.seen)
        and torch.equal(sa.fingerprint, sb.fingerprint)
        and all(
            x.spec == y.spec
            and x.tensors.keys() == y.tensors.keys()
            and all(torch.equal(x.tensors[n], y.tensors[n]) for n in x.tensors)
            for x, y in zip(sa.layers, sb.layers, strict=True)
        )
    )


@pytest.mark.parametrize("feed", FEEDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_continue_after_every_feed(models, family, feed, tmp_path):
    model = models(family)[0]
    for batch in (1, 2):
        try:
            cache, seen_ids = _fill(model, feed, batch)
        except hc.GenerationError as e:  # a combination the family refuses by name (e.g. no early-exit draft)
            pytest.skip(f"{family} refuses {feed}: {e}")
        path = tmp_path / f"{feed}-{batch}.safetensors"
        cache.save(path)  # the model that filled it is recorded as its owner
        loaded = Cache.load(path, model)
        assert _same(cache, loaded), (family, feed, batch)
        new = prompts(cache.batch_size, 3, seed=10 + batch)
        after_original = model(new, cache)
        after_loaded = model(new, loaded)
        assert torch.equal(after_original, after_loaded), (family, feed, batch)
        if seen_ids is not None:  # the oracle: the whole sequence at once in a fresh cache
            whole = model(torch.cat([seen_ids, new], dim=1))[:, -3:]
            torch.testing.assert_close(after_loaded, whole, atol=1e-4, rtol=1e-4)
