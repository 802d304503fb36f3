"""The generation loop's named parts (issue 24): GenerationConfig, logits processors, stopping criteria, streamers.

Oracles: the keyword API for the config; a naive loop (the whole sequence recomputed on a fresh cache every step,
the processor applied by hand, argmax) for processors; plain generation for criteria and streamers."""

import pytest
import torch

import hybridcache as hc
from hybridcache.generation.config import UnknownGenerationSetting
from hybridcache.generation.hooks import BaseStreamer
from hybridcache.generation.loop import GenerationConfig, GenerationConfigError
from hybridcache.generation.sources.speculative import EarlyExitDraft
from hybridcache.models.core.base import GenerationError, GenerationTypeError
from tests.models.conftest import prompts


@pytest.fixture(scope="module")
def model(models):
    return models("gemma3")[0]


@pytest.fixture(scope="module")
def hybrid(models):
    return models("jamba")[0]


def test_config_is_the_same_call_as_keywords(model):
    ids = prompts(2, 6, seed=1)
    settings = dict(max_new_tokens=5, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, seed=11, eos_token_id=3)
    by_keywords = hc.generate(model, ids, **settings)
    by_config = hc.generate(model, ids, generation_config=GenerationConfig(**settings))
    assert torch.equal(by_keywords.sequences, by_config.sequences)
    assert torch.equal(by_keywords.logits, by_config.logits)
    # keywords override the config's fields, the config itself is not changed
    cfg = GenerationConfig(max_new_tokens=9, do_sample=True, seed=11)
    overridden = hc.generate(model, ids, generation_config=cfg, max_new_tokens=3, seed=5)
    assert torch.equal(
        overridden.sequences, hc.generate(model, ids, max_new_tokens=3, do_sample=True, seed=5).sequences
    )
    assert cfg.max_new_tokens == 9 and cfg.seed == 11
    # the positional max_new_tokens of the old signature still works
    assert torch.equal(hc.generate(model, ids, None, 4).sequences, hc.generate(model, ids, max_new_tokens=4).sequences)


@pytest.mark.parametrize("how", ["plain", "recompute", "speculative"])
def test_streamer_receives_exactly_the_generated_tokens_in_order(model, how):
    ids = prompts(2, 7, seed=2)
    first = hc.generate(model, ids, max_new_tokens=6).sequences[0, 7:9].tolist()
    eos = first[1]  # row 0 finishes at its second token: the stream carries the padding after it too
    got, ends = [], []

    class Recorder(BaseStreamer):
        def put(self, tokens):
            got.append(tokens.clone())

        def end(self):
            ends.append(len(got))

    extra = {"recompute": dict(use_cache=False), "speculative": dict(draft_model=EarlyExitDraft(model, 1))}
    out = hc.generate(model, ids, max_new_tokens=6, eos_token_id=eos, streamer=Recorder(), **extra.get(how, {}))
    assert torch.equal(torch.stack(got, dim=1), out.sequences[:, 7:])
    assert ends == [out.sequences.shape[1] - 7]  # end() once, after the last put
    # a plain callable is a streamer too
    seen = []
    hc.generate(model, ids, max_new_tokens=3, streamer=lambda t: seen.append(t.tolist()))
    assert seen == hc.generate(model, ids, max_new_tokens=3).sequences[:, 7:].T.tolist()


def test_a_custom_stopping_criterion_stops_early(hybrid):
    ids = prompts(2, 5, seed=3)
    full = hc.generate(hybrid, ids, max_new_tokens=8).sequences
    # every row at 3 new tokens: the loop ends there
    out = hc.generate(hybrid, ids, max_new_tokens=8, stopping_criteria=[lambda seq, scores: seq.shape[1] >= 5 + 3])
    assert torch.equal(out.sequences, full[:, : 5 + 3])
    # row 1 only, after its first token: row 1 is padded from then on, row 0 runs to the end
    calls = []

    def row_one(seq, scores):
        calls.append(seq.shape[1])
        return torch.tensor([False, True])

    out = hc.generate(hybrid, ids, max_new_tokens=8, stopping_criteria=[row_one], pad_token_id=0)
    assert torch.equal(out.sequences[0], full[0])
    assert torch.equal(out.sequences[1, :6], full[1, :6]) and out.sequences[1, 6:].eq(0).all()
    assert calls == list(range(6, 14))  # once per step, with the sequence so far


def _naive(model, ids, steps, processor):
    """The oracle: no cache at all, the whole sequence recomputed every step, the processor applied, argmax."""
    seq = ids.clone()
    for _ in range(steps):
        logits = model(seq, model.make_cache(seq.shape[0]))[:, -1]
        seq = torch.cat([seq, processor(seq, logits).argmax(-1, keepdim=True)], dim=1)
    return seq


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_custom_logits_processor_is_applied(hybrid, use_cache):
    def no_repeat(seq, scores):  # no token of the row again, and at even lengths not the 3 most likely either
        scores = scores.scatter(-1, seq, float("-inf"))
        if seq.shape[1] % 2 == 0:
            scores = scores.scatter(-1, scores.topk(3, dim=-1).indices, float("-inf"))
        return scores

    ids = prompts(2, 6, seed=4)
    out = hc.generate(hybrid, ids, max_new_tokens=7, logits_processor=[no_repeat], use_cache=use_cache)
    want = _naive(hybrid, ids, 7, no_repeat)
    assert torch.equal(out.sequences, want)
    for row in out.sequences.tolist():
        assert len(set(row[6:])) == 7 and not set(row[6:]) & set(row[:6])
    assert not torch.equal(out.sequences, hc.generate(hybrid, ids, max_new_tokens=7).sequences)  # it did change


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=1.5), "top_p"),
        (dict(do_sample="yes"), "do_sample"),
        (dict(seed=2**70), "seed"),
        (dict(pad_token_id=-1), "pad_token_id"),
        (dict(prefill_chunk_size=0), "prefill_chunk_size"),
        (dict(compile=True, use_cache=False), "compile"),
    ],
)
def test_bad_config_values_are_named_errors(model, settings, message):
    ids = prompts(1, 4, seed=0)
    with pytest.raises(GenerationConfigError, match=message):
        GenerationConfig(**settings).validate()
    with pytest.raises(GenerationConfigError, match=message):
        hc.generate(model, ids, generation_config=GenerationConfig(**settings))
    with pytest.raises(GenerationError, match=message):  # the keyword API: the same named error
        hc.generate(model, ids, **settings)


def test_bad_parts_are_named_errors(model):
    ids = prompts(1, 4, seed=0)
    with pytest.raises(UnknownGenerationSetting, match="max_tokens"):
        hc.generate(model, ids, max_tokens=3)
    with pytest.raises(TypeError):  # still what an unexpected keyword raises
        hc.generate(model, ids, max_tokens=3)
    with pytest.raises(GenerationConfigError, match="generation_config"):
        hc.generate(model, ids, generation_config={"max_new_tokens": 3})
    with pytest.raises(GenerationTypeError, match="streamer"):
        hc.generate(model, ids, streamer=5)
    with pytest.raises(GenerationTypeError, match="stopping criterion"):
        hc.generate(model, ids, stopping_criteria=[5])
    with pytest.raises(GenerationError, match="stopping criterion must return"):
        hc.generate(model, ids, stopping_criteria=[lambda s, x: "no"])
    with pytest.raises(GenerationError, match="logits processor must return"):
        hc.generate(model, ids, logits_processor=[lambda s, x: None])
    with pytest.raises(GenerationError, match="logits_processor"):
        hc.generate(model, ids, draft_model=EarlyExitDraft(model, 1), logits_processor=[lambda s, x: x])
