"""Decode runs (accel/runs/decode_run.py): generate's steady decoding of one row feeds the cache once per run of steps.

The oracle is the step-by-step decode (the same model with runs turned off): the same sequences and logits bit for
bit, and the same cache after (keys, values, key positions, counts, the token fingerprint and its history), past
the sliding window, over several runs, with an early eos, sampled, and in a continuation. A failure mid-run leaves
the cache as it was when the run began, and free; a held cache refuses other feeds and operations."""

import copy
import threading

import pytest
import torch

import hybridcache as hc
from hybridcache.accel import FastPath, kernel_status
from hybridcache.accel.runs import decode_run, layer_records
from hybridcache.cache.core.errors import CacheError, CacheThreadError
from tests.models.conftest import prompts

pytestmark = pytest.mark.skipif(not kernel_status().startswith("C kernels"), reason="the C kernels are not built")


@pytest.fixture(scope="module")
def gemma(checkpoints):
    loaded = {}

    def get(weights=None):
        if weights not in loaded:
            loaded[weights] = hc.from_pretrained(checkpoints("gemma3"), weights=weights)
        return loaded[weights]

    return get


def _starts(monkeypatch) -> list[int]:
    """The capacity of each run started."""
    started, real = [], decode_run.DecodeRun.start.__func__

    def start(cls, model, cache, capacity, ids, h):
        run = real(cls, model, cache, capacity, ids, h)
        if run is not None:
            started.append(capacity)
        return run

    monkeypatch.setattr(decode_run.DecodeRun, "start", classmethod(start))
    return started


def _state(cache) -> list[torch.Tensor]:
    seq = cache.seq
    out = [seq.seen.clone(), torch.tensor(seq.columns), seq.fingerprint.clone(), seq.history()]
    for e in cache.entries:
        out += [e.keys.clone(), e.values.clone(), e.key_pos.clone()]
    return out


def _same_state(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def _generate(model, ids, monkeypatch, runs: bool, **kw):
    with monkeypatch.context() as m:
        started = _starts(m)
        out = hc.generate(model, ids, decode_runs=runs, **kw)  # (False: every step through model.feed_block)
    return out, started


@pytest.mark.parametrize("weights", [None, "bfloat16", "int8"])
@pytest.mark.parametrize("run_tokens, runs", [(128, [19]), (5, [5, 5, 5, 4])])
def test_a_run_is_the_step_by_step_decode(gemma, monkeypatch, weights, run_tokens, runs):
    model = gemma(weights)
    ids = prompts(1, 7, seed=5)
    monkeypatch.setattr(FastPath, "run_tokens", run_tokens)
    got, started = _generate(model, ids, monkeypatch, True, max_new_tokens=20)  # 7 + 20: past the window of 8
    want, none = _generate(model, ids, monkeypatch, False, max_new_tokens=20)
    assert started == runs and none == []  # 19 tokens fed after the prompt
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.logits, want.logits)
    _same_state(_state(got.cache), _state(want.cache))
    # a continuation of each cache, by a run and step by step: the same again
    more, started = _generate(model, got.sequences, monkeypatch, True, max_new_tokens=6, cache=got.cache)
    again, _ = _generate(model, want.sequences, monkeypatch, False, max_new_tokens=6, cache=want.cache)
    assert started == ([6] if run_tokens > 6 else [5, 1])  # the uncached token and 5 more, in runs of 5 at most
    assert torch.equal(more.sequences, again.sequences) and torch.equal(more.logits, again.logits)
    _same_state(_state(more.cache), _state(again.cache))


@pytest.mark.parametrize("sampled", [False, True])
def test_stopped_by_eos(gemma, monkeypatch, sampled):
    """Greedy (many steps per C call) and sampled (one C call per step) runs stop where step-by-step does."""
    model, ids = gemma(), prompts(1, 6, seed=7)
    draw = {"do_sample": True, "seed": 3} if sampled else {}
    want, _ = _generate(model, ids, monkeypatch, False, max_new_tokens=12, **draw)
    eos = int(want.sequences[0, 6 + 5])  # the 6th token: the generation stops there
    first = int((want.sequences[0, 6:] == eos).nonzero()[0])
    kw = {"max_new_tokens": 12, "eos_token_id": [eos, 1], **draw}
    got, started = _generate(model, ids, monkeypatch, True, **kw)
    stopped, _ = _generate(model, ids, monkeypatch, False, **kw)
    assert started == [11] and first <= 5
    assert torch.equal(got.sequences, stopped.sequences) and torch.equal(got.logits, stopped.logits)
    assert got.logits.shape[1] == first + 1
    _same_state(_state(got.cache), _state(stopped.cache))


class _FailingLibrary:
    """The library, with hc_decode_steps running 2 steps and then reporting a failed allocation."""

    def __init__(self, lib):
        self.lib = lib

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def hc_decode_steps(self, *args):
        args = list(args)
        args[7] = min(2, args[7])  # steps
        self.lib.hc_decode_steps(*args)
        return -1


@pytest.mark.parametrize("sampled", [False, True])
def test_a_failed_run_leaves_the_cache_as_it_began_and_free(gemma, monkeypatch, sampled):
    """Greedy: the C loop fails after 2 steps; sampled: the third step's stack call fails."""
    model, ids = gemma("int8"), prompts(1, 6, seed=9)
    kw = {"do_sample": True, "seed": 1} if sampled else {}
    out = hc.generate(model, ids, max_new_tokens=3, **kw)
    began = copy.deepcopy(out.cache)
    if sampled:  # its run begins after the continuation's first block (the uncached token); greedy's feeds it
        hc.generate(model, out.sequences, max_new_tokens=1, cache=began, **kw)
    calls, real = [], decode_run.call_table

    def failing(table):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("no memory (test)")
        real(table)

    with monkeypatch.context() as m:
        m.setattr(decode_run, "call_table", failing)
        lib = _FailingLibrary(decode_run._library())
        m.setattr(decode_run, "_library", lambda: lib)
        with pytest.raises(MemoryError, match="test" if sampled else "no memory"):
            hc.generate(model, out.sequences, max_new_tokens=8, cache=out.cache, **kw)
    assert len(calls) == (3 if sampled else 0)
    _same_state(_state(out.cache), _state(began))  # the steps that ran were never fed
    fresh = hc.generate(model, ids, max_new_tokens=7, **kw)
    held = out.cache.columns  # (greedy: 8, the prompt and 2 tokens; sampled: 9)
    more = fresh.sequences[:, : held + 1]  # one token it has not seen
    again, started = _generate(model, more, monkeypatch, True, max_new_tokens=3, cache=out.cache, **kw)
    if not sampled:  # (sampling draws from the seed anew: the same tokens only from the same start)
        assert torch.equal(again.sequences, fresh.sequences[:, : held + 4])
        assert torch.equal(again.logits, fresh.logits[:, held - 5 : held - 2])
    assert started == [2 if sampled else 3] and torch.equal(again.sequences[:, : held + 1], more)


def test_one_run_stepped_then_greedy(gemma, monkeypatch):
    """A run's steps by `step` (one C call each) then by `greedy` (many per call) continue one another: the
    tokens, logits and cache of the step-by-step decode."""
    model, ids = gemma("bfloat16"), prompts(1, 6, seed=13)
    want, _ = _generate(model, ids, monkeypatch, False, max_new_tokens=12)
    out = hc.generate(model, ids, max_new_tokens=1)
    cache, tokens, logits = out.cache, [int(out.sequences[0, -1])], [out.logits[:, 0]]
    with torch.no_grad(), layer_records.steady():
        first = torch.tensor([[tokens[0]]])
        run = decode_run.DecodeRun.start(model, cache, 11, first, model.embed(first))
        assert run is not None
        for _ in range(3):
            t = torch.tensor([[tokens[-1]]])
            logits.append(model.head(run.step(t, model.embed(t)))[:, -1])
            tokens.append(int(logits[-1].argmax()))
        more, rows = run.greedy(model, tokens[-1], 8, [], True)
        run.finish()
    assert run.steps == 11 and more.shape == (8,)
    assert torch.equal(torch.tensor(tokens[1:] + more.tolist()), want.sequences[0, 7:])
    assert torch.equal(torch.cat([*logits, rows]), want.logits[0])
    _same_state(_state(cache), _state(want.cache))


@pytest.mark.parametrize("how", ["no head form", "greedy declines"])
def test_no_greedy_loop_falls_back_to_runs_a_step(gemma, monkeypatch, how):
    """A model whose head the C loop does not compute (checked before a run starts), or a greedy call that declines
    once a run has started (that run let go, nothing fed): runs of one C call a step, the same tokens and cache."""
    model, ids = gemma(), prompts(1, 6, seed=19)
    first = hc.generate(model, ids, max_new_tokens=3)
    want, _ = _generate(model, first.sequences, monkeypatch, False, max_new_tokens=6, cache=copy.deepcopy(first.cache))
    with monkeypatch.context() as m:
        if how == "no head form":
            m.setattr(type(model), "embed_head_parts", lambda self: None)
        else:
            m.setattr(decode_run.DecodeRun, "greedy", lambda *a: (_ for _ in ()).throw(NotImplementedError("test")))
        got, started = _generate(model, first.sequences, m, True, max_new_tokens=6, cache=first.cache)
    # greedy declines: its run (6 slots, nothing fed) is let go; the prefill, then runs of a C call a step (5)
    assert started == ([5] if how == "no head form" else [6, 5])
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.logits, want.logits)
    _same_state(_state(got.cache), _state(want.cache))


def test_a_run_refuses_what_does_not_fit(gemma):
    """Named errors before any C call, and the cache as it was once the run is abandoned."""
    model, ids = gemma("int8"), prompts(1, 6, seed=17)
    cache = hc.generate(model, ids, max_new_tokens=2).cache
    before, first = _state(cache), torch.tensor([[5]])
    with torch.no_grad():
        assert decode_run.DecodeRun.start(model, cache, 4, first, model.embed(first)) is None  # not steady
        with layer_records.steady():
            for capacity in (0, -3):
                assert decode_run.DecodeRun.start(model, cache, capacity, first, model.embed(first)) is None
            run = decode_run.DecodeRun.start(model, cache, 4, first, model.embed(first))
            h = model.embed(first)
            for bad in ((-1, 2, []), (model.vocab_size, 2, []), (5, 0, []), (5, 5, []), (5, 2, [-1]), (5, 2.0, [])):
                with pytest.raises(ValueError, match="do not fit"):
                    run.greedy(model, *bad, False)
            for bad_ids, bad_h in ((torch.tensor([[5, 6]]), h), (first, h[..., :-1]), (first, h.double())):
                with pytest.raises(ValueError, match="DecodeRun.step"):
                    run.step(bad_ids, bad_h)
            assert run.steps == 0
            run.abandon()
            with pytest.raises(RuntimeError, match="over"):
                run.step(first, h)
            with pytest.raises(RuntimeError, match="over"):
                run.greedy(model, 5, 1, [], False)
    _same_state(_state(cache), before)
    cache.crop(4)  # free


def test_a_held_cache_refuses_other_feeds_and_operations(gemma):
    model, ids = gemma(), prompts(1, 6, seed=11)
    cache = hc.generate(model, ids, max_new_tokens=2).cache
    before = _state(cache)
    reserved = cache.reserve_decode(4)
    assert reserved is not None and all(r.end - r.start == e.keys.shape[2] for r, e in zip(reserved, cache.entries))
    with pytest.raises(CacheError, match="being fed"):
        cache.crop(3)
    with pytest.raises(CacheError, match="being fed"):
        cache.begin_block(None, 1)
    with pytest.raises(CacheError, match="being fed"):
        cache.reserve_decode(2)
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, lambda: cache.feed_reserved(None)))
    thread.start(), thread.join()
    assert len(errors) == 1 and isinstance(errors[0], CacheError)  # another thread cannot end it
    thread = threading.Thread(target=lambda: _catch(errors, lambda: cache.crop(3)))
    thread.start(), thread.join()
    assert isinstance(errors[1], CacheThreadError)
    for bad in (torch.zeros(1, 5, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), torch.zeros(1, 1)):
        with pytest.raises(CacheError, match="ids must be"):
            cache.feed_reserved(bad)  # more tokens than reserved, another batch, not ids: refused, still held
    cache.feed_reserved(None)
    _same_state(_state(cache), before)
    with pytest.raises(CacheError, match="holds no reserve_decode"):
        cache.feed_reserved(None)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(CacheError, match="positive integer"):
            cache.reserve_decode(bad)
    cache.crop(3)  # free again


def _catch(errors: list, fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        errors.append(e)


def test_runs_only_where_nothing_else_runs_between_steps(gemma, monkeypatch):
    """Two rows, a streamer, a logits processor, storage the kernels do not write, a hook, beam search: step by
    step (the same tokens as with runs turned off)."""
    model = gemma()
    one, two = prompts(1, 6, seed=2), prompts(2, 6, seed=2)
    cases = [
        (two, {}),
        (one, {"streamer": lambda tokens: None}),
        (one, {"logits_processor": [lambda ids, scores: scores]}),
        (one, {"cache_config": {"attention": {"type": "full", "storage": "int8"}}}),
    ]
    for ids, kw in cases:
        got, started = _generate(model, ids, monkeypatch, True, max_new_tokens=5, **kw)
        want, _ = _generate(model, ids, monkeypatch, False, max_new_tokens=5, **kw)
        assert started == [] and torch.equal(got.sequences, want.sequences), kw
    handle = model.decoder_layers[0].register_forward_pre_hook(lambda mod, args: None)
    try:
        _, started = _generate(model, one, monkeypatch, True, max_new_tokens=5)
    finally:
        handle.remove()
    assert started == []
    with monkeypatch.context() as m:
        started = _starts(m)
        hc.beam_search(model, one, num_beams=2, max_new_tokens=4)
    assert started == []
