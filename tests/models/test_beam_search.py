"""Beam search through cache.reorder: equals HF's beam search on attention models, and for every family equals
the recompute oracle (each beam's whole sequence recomputed from scratch at every step, no reorder)."""

import pytest
import torch

import hybridcache as hc
from hybridcache.checkpoints.tiny import FAMILIES
from tests.models.conftest import prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_reorder_beam_search_equals_recompute(models, family):
    model = models(family)[0]
    ids = prompts(2, 7, seed=61)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    out = hc.beam_search(model, ids, mask, num_beams=3, max_new_tokens=6)
    ref = hc.beam_search(model, ids, mask, num_beams=3, max_new_tokens=6, use_cache=False)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, atol=1e-4, rtol=1e-5)
    assert out.cache.batch_size == 6 and out.cache.columns == 7 + 6 - 1


@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_matches_hf_beam_search_on_attention_models(models, family):
    model, ref = models(family)
    ids = prompts(2, 8, seed=62)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    ours = hc.beam_search(model, ids, mask, num_beams=4, max_new_tokens=7)
    hf = ref.generate(
        ids,
        attention_mask=mask,
        num_beams=4,
        max_new_tokens=7,
        eos_token_id=None,
        do_sample=False,
        pad_token_id=0,
        early_stopping=False,
        length_penalty=1.0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(ours.sequences, hf.sequences)
    torch.testing.assert_close(ours.sequences_scores, hf.sequences_scores, atol=1e-4, rtol=1e-4)


def test_eos_finishes_hypotheses_like_recompute(models):
    model = models("jamba")[0]
    ids = prompts(2, 6, seed=63)
    free = hc.beam_search(model, ids, num_beams=3, max_new_tokens=8)
    eos = int(free.sequences[0, 6 + 2])
    out = hc.beam_search(model, ids, num_beams=3, max_new_tokens=8, eos_token_id=eos)
    ref = hc.beam_search(model, ids, num_beams=3, max_new_tokens=8, eos_token_id=eos, use_cache=False)
    assert torch.equal(out.sequences, ref.sequences)
    assert (out.sequences[0, 6:] == eos).any()
    with pytest.raises(ValueError, match="num_beams"):
        hc.beam_search(model, ids, num_beams=0)


# Beam search is a token source of generate's loop (generation.token_loop): the loop's stopping criteria and the
# chooser's logits processors reach it. Oracles: beam search with a smaller max_new_tokens, and HF's beam search
# with the same processor.


def test_a_stopping_criterion_ends_a_request_like_max_new_tokens(models):
    model = models("jamba")[0]
    ids = prompts(2, 6, seed=64)
    nb, width = 3, 6
    full = hc.beam_search(model, ids, num_beams=nb, max_new_tokens=6)
    short = hc.beam_search(model, ids, num_beams=nb, max_new_tokens=2)
    calls = []

    def first_request_after_two(input_ids, scores):  # sees the B * nb beam rows
        calls.append(tuple(input_ids.shape))
        return torch.tensor([input_ids.shape[1] >= width + 2] * nb + [False] * nb)

    out = hc.beam_search(model, ids, num_beams=nb, max_new_tokens=6, stopping_criteria=[first_request_after_two])
    assert calls[0] == (2 * nb, width + 1) and len(calls) == 6
    assert torch.equal(out.sequences[0, : width + 2], short.sequences[0])
    pad = model.config.get("pad_token_id") or 0
    assert bool((out.sequences[0, width + 2 :] == pad).all())
    assert torch.equal(out.sequences[1], full.sequences[1])
    torch.testing.assert_close(out.sequences_scores[0], short.sequences_scores[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.sequences_scores[1], full.sequences_scores[1], atol=1e-5, rtol=1e-5)

    # every request stopped: the loop ends there (as max_new_tokens=2), without feeding another step
    everyone = hc.beam_search(
        model, ids, num_beams=nb, max_new_tokens=6, stopping_criteria=[lambda i, s: i.shape[1] >= width + 2]
    )
    assert torch.equal(everyone.sequences, short.sequences)
    assert everyone.cache.columns == short.cache.columns == width + 1
    # a criterion marking only some beams of a request does not end it
    some = hc.beam_search(
        model, ids, num_beams=nb, max_new_tokens=6, stopping_criteria=[lambda i, s: torch.arange(2 * nb) % nb == 0]
    )
    assert torch.equal(some.sequences, full.sequences)


def test_logits_processor_matches_hf_beam_search(models):
    from transformers import LogitsProcessorList

    model, ref = models("gemma3")
    ids = prompts(2, 8, seed=65)
    free = hc.beam_search(model, ids, num_beams=3, max_new_tokens=5)
    banned = sorted(set(free.sequences[:, 8:10].reshape(-1).tolist()))  # the free search's first two tokens
    seen = []

    def ban(input_ids, scores):  # [B * nb, T], log-probs [B * nb, V]
        seen.append(tuple(input_ids.shape))
        scores = scores.clone()
        scores[:, banned] = float("-inf")
        return scores

    ours = hc.beam_search(model, ids, num_beams=3, max_new_tokens=5, logits_processor=[ban])
    assert seen[:2] == [(6, 8), (6, 9)]
    assert not any(t in banned for t in ours.sequences[:, 8:].reshape(-1).tolist())
    hf = ref.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=3,
        max_new_tokens=5,
        eos_token_id=None,
        do_sample=False,
        pad_token_id=0,
        early_stopping=False,
        length_penalty=1.0,
        logits_processor=LogitsProcessorList([ban]),
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(ours.sequences, hf.sequences)
    torch.testing.assert_close(ours.sequences_scores, hf.sequences_scores, atol=1e-4, rtol=1e-4)
