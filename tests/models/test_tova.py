"""TOVA, the score-based eviction type: the kept tokens are the ones an independent recompute of the last query's
attention ranks highest, a row never holds more than its budget, and with a budget above the sequence length it is
exactly full attention."""

import math

import torch

import hybridcache as hc
from hybridcache.cache import Cache, NativeLayer
from tests.models.conftest import prompts


def test_keeps_the_tokens_the_last_query_attends_to_most():
    torch.manual_seed(0)
    b, h, t, d, budget = 2, 2, 12, 8, 5
    cache = Cache.build(
        [NativeLayer("full", {"num_kv_heads": h, "head_dim": d, "dtype": torch.float64})],
        b,
        {"attention": {"type": "tova", "budget": budget}},
    )
    q, k, v = (torch.randn(b, h, t, d, dtype=torch.float64) for _ in range(3))
    with cache.block(None, t):
        view = cache[0].update(k, v)
        scores = (q @ view.keys.transpose(-1, -2)) / math.sqrt(d)
        weights = torch.softmax(scores.masked_fill(~view.mask[:, None], float("-inf")), -1)
        cache[0].observe_attention(weights)
    # independent: the causal weights of the last query, averaged over heads, top `budget` positions
    last = torch.softmax((q[:, :, -1:] @ k.transpose(-1, -2)) / math.sqrt(d), -1)[:, :, 0].mean(1)  # [B, T]
    want = last.topk(budget, dim=1).indices.sort(1).values
    assert torch.equal(cache[0].key_positions(), want)
    assert cache[0].nbytes() == b * budget * 2 * h * d * 8


def test_budget_above_the_length_is_exactly_full_attention(models):
    model, _ = models("jamba", torch.float64)
    ids = prompts(2, 12, seed=3)
    states = {"recurrent": {"state_dtype": torch.float64}}
    full = hc.generate(model, ids, max_new_tokens=8, cache_config=states)
    tova = hc.generate(
        model, ids, max_new_tokens=8, cache_config={**states, "attention": {"type": "tova", "budget": 64}}
    )
    assert torch.equal(full.sequences, tova.sequences)
    assert (full.logits - tova.logits).abs().max().item() < 1e-12


def test_small_budget_holds_the_budget_and_generates(models):
    model, _ = models("jamba")
    out = hc.generate(
        model, prompts(2, 20, seed=4), max_new_tokens=6, cache_config={"attention": {"type": "tova", "budget": 4}}
    )
    attention = [layer for layer in out.cache.layers if layer.kind == "attention"]
    assert attention and all(layer.key_positions().shape[1] == 4 for layer in attention)
    assert not out.cache.is_exact and torch.isfinite(out.logits).all()
