"""Prefix reuse: generation from a stored prefix equals generation without reuse (the oracle), for every family."""

import pytest
import torch

import hybridcache as hc
from hybridcache.checkpoints.tiny import FAMILIES
from hybridcache.generation.sources.prefix import PrefixStore
from tests.models.conftest import prompts


def same(model, ids, store, new=5):
    out = hc.generate(model, ids, max_new_tokens=new, prefix_cache=store)
    ref = hc.generate(model, ids, max_new_tokens=new)  # no reuse
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_and_next_turn_hit_and_equal_no_reuse(models, family):
    model = models(family)[0]
    store = PrefixStore(block_size=8, policy="marconi")
    system = prompts(1, 20, seed=31)
    first = same(model, torch.cat([system, prompts(1, 5, seed=32)], 1), store)
    assert first.stats["hit_tokens"] == 0
    second = same(model, torch.cat([system, prompts(1, 7, seed=33)], 1), store)
    assert second.stats["hit_tokens"] == 0  # the branch point (16 shared tokens) is admitted now
    third = same(model, torch.cat([system, prompts(1, 4, seed=34)], 1), store)
    assert third.stats["hit_tokens"] == 16  # ... and reused from the third request on
    turn = same(model, torch.cat([third.sequences, prompts(1, 3, seed=35)], 1), store)
    assert turn.stats["hit_tokens"] == third.sequences.shape[1] - 1  # the end of the previous turn
    s = store.stats()
    assert s["requests"] == 4 and s["hits"] == 2 and s["tokens_saved"] == 16 + third.sequences.shape[1] - 1
    assert s["bytes_held"] == store.nbytes() > 0


@pytest.mark.parametrize("policy", ["marconi", "all"])
def test_budget_bounds_bytes_and_eviction_keeps_outputs_exact(models, policy):
    model = models("jamba")[0]
    probe = PrefixStore(block_size=8, policy="all")
    same(model, prompts(1, 17, seed=40), probe, new=2)
    one = max(e.nbytes for e in probe.entries.values())
    store = PrefixStore(block_size=8, policy=policy, max_bytes=3 * one)
    system = prompts(1, 24, seed=41)
    for i in range(6):
        same(model, torch.cat([system, prompts(1, 3 + i, seed=42 + i)], 1), store, new=3)
        assert store.nbytes() <= store.max_bytes
    s = store.stats()
    assert s["evicted"] > 0 and s["hits"] >= 1 and s["bytes_held"] <= 3 * one


def test_policy_all_hits_every_boundary(models):
    model = models("mamba")[0]
    store = PrefixStore(block_size=4, policy="all")
    ids = prompts(1, 18, seed=50)
    same(model, ids, store)
    assert same(model, torch.cat([ids[:, :13], prompts(1, 2, seed=51)], 1), store).stats["hit_tokens"] == 12


def test_bad_uses(models):
    model, other = models("mamba")[0], models("mamba2")[0]
    store = PrefixStore()
    with pytest.raises(ValueError, match="one request at a time"):
        hc.generate(model, prompts(2, 5, seed=1), prefix_cache=store)
    hc.generate(model, prompts(1, 5, seed=1), prefix_cache=store, max_new_tokens=1)
    with pytest.raises(ValueError, match="another model"):
        hc.generate(other, prompts(1, 5, seed=1), prefix_cache=store)
    with pytest.raises(ValueError, match="cache="):
        hc.generate(model, prompts(1, 5, seed=1), prefix_cache=store, cache=model.make_cache(1))
    with pytest.raises(ValueError, match="policy"):
        PrefixStore(policy="fifo")
