"""A cache belongs to the thread that generates with it for the whole call (issue 39, item 2).

Between two decode steps of one thread's `generate(cache=...)`, another thread could reset or feed the cache (the
cache's lock is held per block only), and the generating thread returned silently different tokens. Now `generate`
claims the cache from start to end: the other thread's call raises `CacheThreadError` and changes nothing, and the
generating thread's tokens and logits equal an undisturbed run's."""

import threading
import time

import pytest
import torch

import hybridcache as hc
from hybridcache.cache import Cache
from hybridcache.cache.core.errors import CacheThreadError
from hybridcache.generation.sources.prefix import PrefixStore
from tests.models.conftest import prompts

INTRUSIONS = {
    "reset": lambda model, cache: cache.reset(),
    "feed": lambda model, cache: model(prompts(cache.batch_size, 2, seed=9), cache),
    "crop": lambda model, cache: cache.crop(cache.columns),  # a no-op crop every layer type can do
    "repeat": lambda model, cache: cache.repeat(2),
    "begin_block": lambda model, cache: cache.begin_block(None, 1),
}


def _between_steps(model, cache, intrude):
    """Run `intrude(model, cache)` in another thread between the generating thread's steps (from the streamer,
    which runs in the generating thread after each token). Returns what each intrusion raised (None: accepted)."""
    results = []

    def put(tokens):
        box = []

        def other():
            try:
                intrude(model, cache)
                box.append(None)
            except Exception as e:  # noqa: BLE001 - the test looks at which
                box.append(e)

        t = threading.Thread(target=other, daemon=True)
        t.start()
        t.join(timeout=60)
        results.append(box[0] if box else "hung")

    return put, results


@pytest.mark.parametrize("what", sorted(INTRUSIONS))
@pytest.mark.parametrize("family", ["jamba", "gemma3"])
def test_another_thread_cannot_touch_the_cache_between_steps(models, family, what):
    model = models(family)[0]
    ids = prompts(1, 6, seed=1)
    first = hc.generate(model, ids, max_new_tokens=2)
    expected = hc.generate(model, first.sequences, cache=_copy(model, first), max_new_tokens=5)
    put, results = _between_steps(model, first.cache, INTRUSIONS[what])
    out = hc.generate(model, first.sequences, cache=first.cache, max_new_tokens=5, streamer=put)
    assert len(results) == 5 and all(isinstance(r, CacheThreadError) for r in results), results
    assert torch.equal(out.sequences, expected.sequences) and torch.equal(out.logits, expected.logits)
    # after the call the cache is free again: the same intrusion from another thread now works
    put, results = _between_steps(model, out.cache, INTRUSIONS[what])
    put(None)
    assert results == [None]


def _copy(model, out):
    cache = model.make_cache(out.cache.batch_size)
    cache.restore(out.cache.snapshot())
    return cache


def test_decode_runs_are_claimed_too(models, monkeypatch):
    """Greedy decode runs (gemma3) hold the cache during a run; the claim covers the rest of the call. Another thread
    hammers reset() from the start of the run until, after the run has fed the cache, it has had 50 ms of the
    generating thread's time to get in: it never does."""
    model = models("gemma3")[0]
    first = hc.generate(model, prompts(1, 6, seed=2), max_new_tokens=2)
    expected = hc.generate(model, first.sequences, cache=_copy(model, first), max_new_tokens=40)
    stop, outcomes, threads = threading.Event(), [], []

    def hammer():
        while not stop.is_set():
            try:
                first.cache.reset()
                outcomes.append("reset")
            except CacheThreadError:
                outcomes.append("refused")

    reserve, feed = Cache.reserve_decode, Cache.feed_reserved

    def reserve_and_start(self, tokens):
        if self is first.cache and not threads:
            threads.append(threading.Thread(target=hammer, daemon=True))
            threads[0].start()
        return reserve(self, tokens)

    def feed_and_wait(self, ids):
        feed(self, ids)
        if self is first.cache and threads:  # the run has let go of the cache; generate has not returned yet
            time.sleep(0.05)
            stop.set()
            threads[0].join(timeout=60)

    monkeypatch.setattr(Cache, "reserve_decode", reserve_and_start)
    monkeypatch.setattr(Cache, "feed_reserved", feed_and_wait)
    try:
        out = hc.generate(model, first.sequences, cache=first.cache, max_new_tokens=40)
        assert threads and stop.is_set(), "no decode run started"
    finally:
        stop.set()
    assert "reset" not in outcomes and outcomes, outcomes[:5]
    assert torch.equal(out.sequences, expected.sequences)


def test_a_prefix_store_shared_by_threads_serves_one_request_at_a_time(models, monkeypatch):
    """Two threads sharing a PrefixStore: while one request's prepare runs (paused here inside the model), the other
    waits; both outputs equal serial generation."""
    model = models("jamba")[0]
    store = PrefixStore(block_size=4, policy="all")
    a, b = prompts(1, 13, seed=3), prompts(1, 13, seed=4)
    serial = [hc.generate(model, p, max_new_tokens=3).sequences for p in (a, b)]
    inside, release, entered = threading.Event(), threading.Event(), []
    real = type(model).feed_block

    def paused(self, input_ids, cache, *args, **kwargs):
        entered.append(threading.current_thread().name)
        if threading.current_thread().name == "A" and not inside.is_set():
            inside.set()
            release.wait(timeout=60)
        return real(self, input_ids, cache, *args, **kwargs)

    monkeypatch.setattr(type(model), "feed_block", paused)
    outs = {}
    ta = threading.Thread(
        name="A", target=lambda: outs.update(A=hc.generate(model, a, max_new_tokens=3, prefix_cache=store))
    )
    tb = threading.Thread(
        name="B", target=lambda: outs.update(B=hc.generate(model, b, max_new_tokens=3, prefix_cache=store))
    )
    ta.start()
    assert inside.wait(timeout=60)
    tb.start()
    tb.join(timeout=2)  # B must be waiting for A's prepare, not running beside it
    assert "B" not in entered and tb.is_alive()
    release.set()
    ta.join(timeout=60)
    tb.join(timeout=60)
    assert torch.equal(outs["A"].sequences, serial[0]) and torch.equal(outs["B"].sequences, serial[1])
