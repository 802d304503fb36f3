"""A block is bound to the thread that opened it: another thread can neither feed it, commit it, abort it nor
release its lock, and its attempts change nothing (real threads, synchronised by events)."""

import threading

import pytest
import torch

from hybridcache.cache.core.errors import CacheError, CacheThreadError
from tests.cache.helpers import feed, feed_layer, hybrid_cache, state_equal


def _attempts(cache):
    """What a second thread may try while another thread's block is open (each must raise CacheThreadError)."""
    k = torch.randn(2, 2, 1, 4)
    return {
        "update a layer": lambda: cache[0].update(k, k.clone()),
        "update a recurrent layer": lambda: cache[3].update(
            **{n: torch.zeros_like(t) for n, t in cache[3].states.items()}
        ),
        "abort the block": cache.abort_block,
        "commit the block": cache.end_block,
        "read the open block": lambda: cache.current_block,
        "open another block": lambda: cache.begin_block(None, 1),
        "a with-block": lambda: cache.block(None, 1).__enter__(),
        "reset": cache.reset,
        "snapshot": cache.snapshot,
        "reorder": lambda: cache.reorder([1, 0]),
        "repeat": lambda: cache.repeat(2),
    }


def _in_thread(fn):
    """Run fn() in a new thread; return what it raised (or None)."""
    out = {}

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join(30)
    assert not t.is_alive()
    return out.get("error")


def test_another_thread_cannot_touch_an_open_block():
    cache, reference = hybrid_cache(), hybrid_cache()
    feed(cache, 3, seed=1)
    feed(reference, 3, seed=1)
    opened, probed = threading.Event(), threading.Event()
    errors, owner_error = {}, {}

    def owner():  # thread A: opens a block, feeds half of it, waits for B's attempts, then finishes it
        try:
            g = torch.Generator().manual_seed(7)
            with cache.block(None, 1):
                feed_layer(cache[0], 1, g)
                opened.set()
                assert probed.wait(30)
                for layer in cache.layers[1:]:
                    feed_layer(layer, 1, g)
        except BaseException as e:  # noqa: BLE001
            owner_error["error"] = e
            opened.set()

    def intruder():  # thread B: every attempt must raise CacheThreadError and disturb nothing
        assert opened.wait(30)
        for name, call in _attempts(cache).items():
            try:
                call()
                errors[name] = None
            except BaseException as e:  # noqa: BLE001
                errors[name] = e
        probed.set()

    a, b = threading.Thread(target=owner), threading.Thread(target=intruder)
    a.start()
    b.start()
    a.join(60)
    b.join(60)
    assert not a.is_alive() and not b.is_alive()
    assert "error" not in owner_error, f"the owner's block was disturbed: {owner_error.get('error')!r}"
    for name, e in errors.items():
        assert isinstance(e, CacheThreadError), f"{name}: {e!r}"
        assert isinstance(e, CacheError)
    assert "thread" in str(errors["update a layer"]) and "opened" in str(errors["update a layer"])
    g = torch.Generator().manual_seed(7)  # the same block fed by one thread
    with reference.block(None, 1):
        for layer in reference.layers:
            feed_layer(layer, 1, g)
    assert state_equal(cache.snapshot(), reference.snapshot())


def test_the_block_and_its_lock_survive_an_abort_from_another_thread():
    cache = hybrid_cache()
    feed(cache, 2)
    before = cache.snapshot()
    block = cache.begin_block(None, 1)
    error = _in_thread(cache.abort_block)
    assert isinstance(error, CacheThreadError)
    assert cache.seq.block is block  # still open, still this thread's
    error = _in_thread(cache.snapshot)  # the lock is still held: another thread cannot use the cache
    assert isinstance(error, CacheThreadError) and "another thread" in str(error)
    cache.abort_block()  # the owner can still drop it
    assert state_equal(cache.snapshot(), before)
    assert _in_thread(cache.snapshot) is None  # once closed, the cache can be handed over


def test_a_handed_over_cache_works_in_the_new_thread():
    cache = hybrid_cache()
    feed(cache, 2)
    assert _in_thread(lambda: feed(cache, 1, seed=3)) is None  # no block open: another thread may feed it
    assert cache.columns == 3


def test_an_update_from_another_thread_is_not_staged():
    cache = hybrid_cache()
    feed(cache, 2)
    cache.begin_block(None, 1)
    try:
        k = torch.randn(2, 2, 1, 4)
        error = _in_thread(lambda: cache[0].update(k, k.clone()))
        assert isinstance(error, CacheThreadError)
        assert not cache[0].fed  # nothing staged into this thread's block
    finally:
        cache.abort_block()


@pytest.mark.parametrize("rounds", [20])
def test_two_threads_racing_for_one_cache_never_corrupt_it(rounds):
    """Two threads feed one cache in a loop: each block is either fed whole by one thread or refused."""
    cache = hybrid_cache(types=("full", "mamba"))
    start = threading.Barrier(2)
    fed = [0, 0]

    def worker(i):
        start.wait(30)
        g = torch.Generator().manual_seed(i)
        for _ in range(rounds):
            try:
                with cache.block(None, 1):
                    for layer in cache.layers:
                        feed_layer(layer, 1, g)
                fed[i] += 1
            except CacheThreadError:
                pass

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert cache.columns == sum(fed) and cache.seq.block is None
    assert bool((cache.seen == sum(fed)).all())


def test_the_claiming_thread_waits_out_an_intruder_being_refused():
    """Another thread that is being refused holds the lock for a moment (between its acquire and its refusal): the
    thread that claimed the cache must wait for it, not be refused itself (seen once under load: generate's own
    decode run raised CacheThreadError)."""
    cache = hybrid_cache()
    holding, done = threading.Event(), threading.Event()

    def intruder_in_its_window():
        cache._lock.acquire()  # exactly what a refused `_acquire` does before it sees the claim
        holding.set()
        done.wait(0.3)
        cache._lock.release()

    with cache.claimed():
        t = threading.Thread(target=intruder_in_its_window)
        t.start()
        assert holding.wait(10)
        feed(cache, 2)  # the owner's block: waits for the lock instead of raising
        done.set()
        t.join()
    assert cache.columns == 2
