"""Prompt-lookup drafting and sampled speculative decoding.

Oracles: a naive n-gram search written here (lookup); plain greedy generation of the target (greedy output with
a prompt-lookup draft is the same tokens); the distributions themselves for speculative sampling: the rule
(`sampled_round`) on synthetic p and q must give tokens distributed as p at every position a round reaches, and
end to end the first two sampled tokens' joint distribution must be the target's, computed here from HF's model
of the same checkpoint with top-k written out by hand. Each distribution test also checks that the draft's own
distribution is far from the target's, so accepting drafts blindly would fail it.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridcache as hc
from hybridcache.generation.sources.drafts import DraftProbs, PromptLookupDraft
from hybridcache.generation.sources.speculative import sampled_round
from tests.models.conftest import prompts
from tests.models.test_speculative import perturbed


def naive_lookup(tokens: list[int], r: int, max_ngram: int, min_ngram: int) -> list[int]:
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the latest earlier occurrence
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + r]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 6), st.integers(1, 4), st.integers(1, 4))
def test_lookup_matches_a_naive_search(tokens, r, a, b):
    lo, hi = min(a, b), max(a, b)
    got = PromptLookupDraft(max_ngram=hi, min_ngram=lo).lookup(torch.tensor(tokens), r).tolist()
    assert got == naive_lookup(tokens, r, hi, lo)


def test_lookup_bad_arguments():
    for kw in ({"max_ngram": 0}, {"min_ngram": True}, {"max_ngram": 2, "min_ngram": 3}, {"max_ngram": 1.5}):
        with pytest.raises(ValueError, match="PromptLookupDraft"):
            PromptLookupDraft(**kw)


@pytest.mark.parametrize("family", ["gemma3", "mamba2", "jamba", "qwen3_next"])
def test_prompt_lookup_greedy_is_plain_greedy(models, family):
    model = models(family)[0]
    base = prompts(2, 6, seed=5)
    ids = torch.cat([base, base, base[:, :3]], 1)  # repeats: lookups find n-grams and propose
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    plain = hc.generate(model, ids, attention_mask=mask, max_new_tokens=12)
    spec = hc.generate(
        model, ids, attention_mask=mask, max_new_tokens=12, draft_model=hc.PromptLookupDraft(), num_draft_tokens=4
    )
    assert torch.equal(spec.sequences, plain.sequences)
    torch.testing.assert_close(spec.logits, plain.logits, atol=1e-4, rtol=1e-4)
    assert spec.stats["drafted"] > 0 and spec.stats["rollback"]["draft"] == "none"


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("deterministic", [False, True])
def test_sampled_round_gives_the_target_distribution_at_every_position(deterministic):
    """Synthetic p [r + 1 positions, V] and q: over 200k rows, the token at each position a round reaches (every
    accepted position, the first rejected one, the bonus) is distributed as p at that position."""
    g = torch.Generator().manual_seed(0)
    rows, r, v = 200_000, 3, 6
    p = torch.softmax(torch.randn(r + 1, v, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(r, v, generator=g) * 2, -1)
    probs = DraftProbs(1.0, None, None, torch.Generator().manual_seed(1))
    if deterministic:  # prompt lookup: fixed proposals, q one-hot
        proposal = torch.randint(0, v, (rows, r), generator=g)
        q_rows = None
    else:
        proposal = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=g) for j in range(r)], 1)
        q_rows = q.expand(rows, r, v)
    accepted, tokens = sampled_round(p.expand(rows, r + 1, v), q_rows, proposal, probs)
    for j in range(r + 1):
        reached = accepted >= j  # the round emits position j for these rows
        counts = torch.bincount(tokens[reached, j], minlength=v).double()
        n = float(counts.sum())
        within = (counts / n - p[j]).abs() <= 5 * (p[j] * (1 - p[j]) / n).sqrt() + 1e-9  # 5 sigma per token
        assert bool(within.all()), (j, (counts / n).tolist(), p[j].tolist())
        assert n > 500  # enough rows reach every position for the bound to mean something
    blind = torch.full((v,), 1 / v) if deterministic else q[0]  # accepting every proposal would give these
    assert tv(blind, p[0]) > 0.1 and 200_000 * float((blind - p[0]).abs().max()) ** 2 > 25 * float(p[0].max())
    assert 0 < float(accepted.float().mean()) < r


def exact_two_token_joint(ref, ids: torch.Tensor, top_k: int) -> dict[tuple[int, int], float]:
    """P(x1, x2) of plain top-k sampling (temperature 1) from HF's model: x1 from softmax over the top-k logits after
    the prompt, x2 the same after prompt + x1. Written here, independent of our sampler."""

    def topk_probs(logits):
        vals, idx = logits.topk(top_k)
        return dict(zip(idx.tolist(), torch.softmax(vals.double(), -1).tolist(), strict=True))

    with torch.no_grad():
        first = topk_probs(ref(ids).logits[0, -1])
        joint = {}
        for x1, p1 in first.items():
            second = topk_probs(ref(torch.cat([ids, torch.tensor([[x1]])], 1)).logits[0, -1])
            joint |= {(x1, x2): p1 * p2 for x2, p2 in second.items()}
    return joint


def sampled_joint(model, prompt, draft, rows=2000, top_k=4):
    """The empirical joint of the first two tokens of `rows` sampled continuations with a one-token draft per round
    (the second token goes through the accept / resample rule and both rollbacks), keyed like the exact joint."""
    out = hc.generate(
        model,
        prompt.repeat(rows, 1),
        max_new_tokens=3,  # x1 sampled plainly, x2 through one round's rule, x3 after it
        do_sample=True,
        top_k=top_k,
        seed=7,
        draft_model=draft,
        num_draft_tokens=1,
        prefill_chunk_size=64,
    )
    assert out.stats["drafted"] >= 1  # the second token went through a round's accept / resample rule
    counts: dict[tuple[int, int], int] = {}
    for pair in out.sequences[:, -3:-1].tolist():
        counts[tuple(pair)] = counts.get(tuple(pair), 0) + 1
    return {k: c / rows for k, c in counts.items()}


def tv_dict(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def test_speculative_sampling_with_a_draft_model_matches_the_targets_distribution(models):
    """gemma3 (attention: crop rollback) with a perturbed copy as draft, sampling top-4. 2,000 rows: the expected
    total variation of the empirical joint is ~0.035."""
    model, ref = models("gemma3")
    prompt = prompts(1, 6, seed=3)
    exact = exact_two_token_joint(ref, prompt, 4)
    draft = perturbed(model, 2.0)
    assert tv_dict(sampled_joint(model, prompt, draft), exact) < 0.08
    first = {}  # the target's first-token distribution, against the draft's own: blind acceptance would fail
    for (x1, _), pr in exact.items():
        first[x1] = first.get(x1, 0.0) + pr
    with torch.no_grad():
        vals, idx = draft.feed_block(prompt, draft.make_cache(1), None)[0, -1].topk(4)
    assert tv_dict(first, dict(zip(idx.tolist(), torch.softmax(vals.double(), -1).tolist(), strict=True))) > 0.1


def test_speculative_sampling_with_prompt_lookup_matches_the_targets_distribution(models):
    """mamba2 (recurrent: the target's rollback recomputes or crops through its trail), prompt lookup. The prompt
    is grown until it holds every first token top-4 sampling can draw, so every row's lookup proposes (deterministic
    proposals, a one-hot q)."""
    model, ref = models("mamba2")
    start = prompts(1, 6, seed=3)
    prompt = start
    for _ in range(8):
        with torch.no_grad():
            first = ref(prompt).logits[0, -1].topk(4).indices
        if set(first.tolist()) <= set(prompt[0].tolist()):
            break
        prompt = torch.cat([prompt, first[None], start], 1)
    assert set(first.tolist()) <= set(prompt[0].tolist())
    exact = exact_two_token_joint(ref, prompt, 4)
    draft = hc.PromptLookupDraft(max_ngram=2)
    assert tv_dict(sampled_joint(model, prompt, draft), exact) < 0.08
    blind = {}  # accepting every proposal: x2 is whatever the lookup proposes after x1
    for (x1, _), pr in exact.items():
        proposed = int(draft.lookup(torch.cat([prompt[0], torch.tensor([x1])]), 1)[0])
        blind[(x1, proposed)] = blind.get((x1, proposed), 0.0) + pr
    assert tv_dict(blind, exact) > 0.3
