"""Speculative decoding: greedy output identical to plain greedy decoding of the target, for every family.

Drafts: a perturbed copy of the target (partial acceptance: rollback inside the window), a model of another family
(mostly rejected: rollback of whole drafts), and the target itself (everything accepted). The oracle is plain
greedy generation of the target without a draft.
"""

import copy

import pytest
import torch

import hybridcache as hc
from hybridcache.checkpoints.tiny import FAMILIES
from hybridcache.generation.sources.speculative import EarlyExitDraft, rollback_mode
from tests.models.conftest import prompts


def perturbed(model, scale, seed=0):
    """A copy of `model` whose output head is noisier: it agrees with the target often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        params = dict(draft.named_parameters())  # the output head [V, D] (the embedding when they are tied)
        w = params.get("lm_head.weight", next((p for p in params.values() if p.shape[0] == model.vocab_size), None))
        w.add_(torch.randn(w.shape, generator=g) * scale * w.std())
    return draft


class SometimesWrong(torch.nn.Module):
    """A draft that is the target itself except at every `every`-th position, where it proposes another token:
    partial acceptance by construction, for any family, so rollbacks land at every offset of a draft."""

    def __init__(self, target, every=3):
        super().__init__()
        self.target, self.every = target, every
        self.vocab_size, self.device = target.vocab_size, target.device

    def make_cache(self, *args, **kwargs):
        return self.target.make_cache(*args, **kwargs)

    def feed_block(self, ids, cache, valid=None, step=None, check=True, last_only=False):
        logits = self.target.feed_block(ids, cache, valid, last_only=last_only).clone()
        t = logits.shape[1]  # the block's last t positions
        pos = cache.seen[:, None] - t + torch.arange(t)  # [B, T] positions of the block's tokens
        wrong = (pos % self.every == self.every - 1)[..., None]
        other = torch.nn.functional.one_hot((logits.argmax(-1) + 1) % self.vocab_size, self.vocab_size).bool()
        return torch.where(wrong & other, logits.max(-1, keepdim=True).values + 1, logits)


def check_same_as_plain(model, draft, ids, mask=None, k=3, new=14, **kw):
    plain = hc.generate(model, ids, attention_mask=mask, max_new_tokens=new, **kw)
    spec = hc.generate(model, ids, attention_mask=mask, max_new_tokens=new, draft_model=draft, num_draft_tokens=k, **kw)
    assert torch.equal(spec.sequences, plain.sequences)
    live = torch.ones(spec.logits.shape[:2], dtype=torch.bool)  # after its eos a row's logits mean nothing
    if kw.get("eos_token_id") is not None:
        hit = (spec.sequences[:, ids.shape[1] :] == kw["eos_token_id"]).long().cumsum(1)
        live = (hit - (hit > 0).long() * (spec.sequences[:, ids.shape[1] :] == kw["eos_token_id"]).long()) == 0
        assert not bool(live.all())  # the eos case really stops a row early
    torch.testing.assert_close(spec.logits[live], plain.logits[live], atol=1e-4, rtol=1e-4)
    return spec


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_identical_to_plain_greedy(models, family):
    model = models(family)[0]
    ids = prompts(2, 9, seed=21)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :2] = 0
    spec = check_same_as_plain(model, SometimesWrong(model), ids, mask, k=4)
    s = spec.stats
    assert 0 < s["accepted"] < s["drafted"], s  # some drafts accepted, some rolled back
    assert s["target_calls"] < 1 + spec.sequences.shape[1] - 9
    check_same_as_plain(model, perturbed(model, 0.5), ids, mask, k=3)  # a noisier copy of the target
    other = models("mamba" if family != "mamba" else "gemma3")[0]
    check_same_as_plain(model, other, ids[:1], k=4, new=10)  # another family: mostly rejected
    half = EarlyExitDraft(model, max(1, len(model.decoder_layers) // 2))  # self-speculative: the first layers
    check_same_as_plain(model, half, ids, mask, k=2, new=9)
    full = check_same_as_plain(model, model, ids[:1], k=4, new=11)  # itself: everything accepted
    assert full.stats["acceptance_rate"] == 1.0 and full.stats["target_calls"] == 1 + 2


def test_rollback_modes_and_continuation(models):
    jamba, gemma = models("jamba")[0], models("gemma3")[0]
    out = hc.generate(
        jamba, prompts(1, 6, seed=22), max_new_tokens=8, draft_model=perturbed(jamba, 1.5), num_draft_tokens=3
    )
    assert out.stats["rollback"]["target"] == "crop"  # full attention + mamba with rollback
    more = torch.cat([out.sequences, prompts(1, 2, seed=23)], 1)
    cont = hc.generate(jamba, more, cache=out.cache, max_new_tokens=4)  # the returned cache continues
    ref = hc.generate(jamba, more, max_new_tokens=4, use_cache=False)
    assert torch.equal(cont.sequences, ref.sequences)
    g = hc.generate(gemma, prompts(1, 6, seed=22), max_new_tokens=8, draft_model=gemma, num_draft_tokens=3)
    assert g.stats["rollback"]["target"] == "crop"  # sliding windows keep `spare` tokens for rollback
    static = {"attention": {"max_length": 64}}  # a preallocated ring holds no spare tokens: snapshot + recompute
    g = hc.generate(
        gemma, prompts(1, 6, seed=22), max_new_tokens=8, draft_model=gemma, num_draft_tokens=3, cache_config=static
    )
    assert g.stats["rollback"]["target"] == "recompute"
    assert rollback_mode(jamba.make_cache(1), 1) == "recompute"  # no rollback: no crop


def test_eos_and_bad_requests(models):
    model = models("mamba2")[0]
    ids = prompts(2, 7, seed=24)
    free = hc.generate(model, ids, max_new_tokens=10)
    eos = int(free.sequences[0, 7 + 3])
    check_same_as_plain(model, perturbed(model, 1.0), ids, k=3, new=10, eos_token_id=eos)
    for kw, msg in [
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"logits_processor": [lambda ids, scores: scores]}, "logits_processor"),
        ({"cache": model.make_cache(2)}, "cache="),
        ({"compile": True}, "compile"),
    ]:
        with pytest.raises(ValueError, match=msg):
            hc.generate(model, ids, draft_model=model, **kw)
