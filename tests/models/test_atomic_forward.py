"""model(ids, cache, mask): one mask rule, everything validated before the first cache layer changes, a failed
forward leaves the whole cache as it was, and a Cache refuses concurrent use."""

import threading

import pytest
import torch

from hybridcache.cache import CacheError
from tests.cache.helpers import state_equal
from tests.models.conftest import prompts


@pytest.fixture(scope="module")
def jamba(models):
    return models("jamba")[0]


@pytest.mark.parametrize("value,message", [(0.5, "bool or an integer"), (2, "only 0 and 1"), (-1, "only 0 and 1")])
def test_mask_values_other_than_0_1_are_refused(jamba, value, message):
    cache = jamba.make_cache(1)
    mask = torch.full((1, 4), value)
    mask[0, -1] = 1
    with pytest.raises(ValueError, match=message):
        jamba(prompts(1, 4, seed=0), cache, mask)
    assert cache.columns == 0


def test_bool_and_int_masks_give_the_same_logits(jamba):
    ids, mask = prompts(2, 5, seed=1), torch.tensor([[0, 1, 1, 1, 1], [1] * 5])
    a = jamba(ids, jamba.make_cache(2), mask)
    b = jamba(ids, jamba.make_cache(2), mask.bool())
    assert torch.equal(a, b)


def test_a_row_of_only_padding_is_refused(jamba):
    with pytest.raises(ValueError, match="all padding"):
        jamba(prompts(2, 3, seed=2), jamba.make_cache(2), torch.tensor([[0, 0, 0], [1, 1, 1]]))


def test_mask_over_cached_columns_must_match_what_the_cache_saw(jamba):
    cache = jamba.make_cache(2)
    jamba(prompts(2, 4, seed=3), cache, torch.tensor([[0, 1, 1, 1], [1] * 4]))
    before = cache.snapshot()
    wrong = torch.ones(2, 6, dtype=torch.long)  # says row 0 had 4 real tokens; the cache saw 3
    with pytest.raises(ValueError, match="row 0 marks 4 of the 4 cached columns"):
        jamba(prompts(2, 2, seed=4), cache, wrong)
    assert state_equal(cache.snapshot(), before)


def test_capacity_of_a_later_layer_is_checked_before_the_first_layer_changes(jamba):
    """Layer 2 (attention) is preallocated for 6 tokens, after two Mamba layers: a 7th token changes nothing."""
    cache = jamba.make_cache(1, {"layers": {2: {"max_length": 6}}})
    jamba(prompts(1, 6, seed=5), cache)
    before = cache.snapshot()
    with pytest.raises(CacheError, match="max_length=6"):
        jamba(prompts(1, 1, seed=6), cache)
    assert state_equal(cache.snapshot(), before)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "preallocated"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_an_exception_in_the_middle_of_a_forward_leaves_every_layer_unchanged(jamba, monkeypatch, static, tokens):
    cache = jamba.make_cache(2, max_length=32 if static else None)
    jamba(prompts(2, 5, seed=7), cache)
    before = cache.snapshot()
    last = jamba.decoder_layers[-1]

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(last, "forward", boom)  # layers 0..2 have already written when this raises
    with pytest.raises(RuntimeError, match="boom"):
        jamba(prompts(2, tokens, seed=8), cache)
    monkeypatch.undo()
    assert state_equal(cache.snapshot(), before)
    # and the cache goes on exactly as if the failed call never happened
    fresh = jamba.make_cache(2, max_length=32 if static else None)
    jamba(prompts(2, 5, seed=7), fresh)
    nxt = prompts(2, 2, seed=9)
    assert torch.equal(jamba(nxt, cache), jamba(nxt, fresh))


def test_concurrent_use_from_two_threads_raises(jamba):
    cache = jamba.make_cache(1)
    cache.begin_block(None, 1)  # thread 1 is in the middle of a block
    errors = []

    def other():
        try:
            jamba(prompts(1, 2, seed=10), cache)
        except CacheError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    cache.abort_block()
    assert errors and "in use by another thread" in errors[0]
    assert cache.columns == 0
    jamba(prompts(1, 2, seed=10), cache)  # usable again afterwards
    assert cache.columns == 2


def test_precision_is_a_setting_of_one_model_not_of_the_process(checkpoints):
    import hybridcache as hc

    a, b = hc.from_pretrained(checkpoints("mamba2")), hc.from_pretrained(checkpoints("mamba2"))
    assert not a.upcast_cpu_float32 and not b.upcast_cpu_float32  # float32 like HF by default
    a.upcast_cpu_float32 = True
    assert a.upcast_cpu_float32 and not b.upcast_cpu_float32
    ids = prompts(1, 9, seed=11)
    diff = (a(ids) - b(ids)).abs().max().item()
    assert 0 < diff < 1e-4  # float32 vs float64 mixer arithmetic: different rounding, same model


def test_compiled_step_is_created_once_even_from_many_threads(jamba):
    from hybridcache.generation.loop import compiled_decode_step

    jamba.__dict__.pop("_compiled_decode_step", None)
    steps = []
    threads = [threading.Thread(target=lambda: steps.append(compiled_decode_step(jamba))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(steps) == 8 and all(s is steps[0] for s in steps)


@pytest.mark.parametrize("chunk", [2, 5])
def test_generate_checks_every_prefill_piece_before_the_first_is_written(jamba, chunk):
    """A prompt that fits the first pieces but overflows a later one (or the decode steps) is refused whole: the
    returned-cache continuation path leaves every layer exactly as it was."""
    import hybridcache as hc

    cache = jamba.make_cache(1, {"layers": {2: {"max_length": 12}}})
    first = hc.generate(jamba, prompts(1, 4, seed=7), max_new_tokens=2, cache=cache)
    before = first.cache.snapshot()
    longer = torch.cat([first.sequences, prompts(1, 7, seed=8)], dim=1)  # 13 tokens: the 3rd..4th piece overflows
    with pytest.raises(ValueError, match="max_length=12"):
        hc.generate(jamba, longer, max_new_tokens=1, cache=first.cache, prefill_chunk_size=chunk)
    assert state_equal(first.cache.snapshot(), before) and first.cache.columns == 5
    fits = torch.cat([first.sequences, prompts(1, 3, seed=9)], dim=1)  # 9 tokens + 3 new - 1 = 11 <= 12
    hc.generate(jamba, fits, max_new_tokens=3, cache=first.cache, prefill_chunk_size=chunk)
