"""Beam search through cache.reorder: equals HF's beam search on attention models, and for every family equals
the recompute oracle (each beam's whole sequence recomputed from scratch at every step, no reorder)."""

import pytest
import torch

import hybridcache as hc
from hybridcache.tiny_models import FAMILIES
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
