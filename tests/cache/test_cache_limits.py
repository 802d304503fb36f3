"""Indexing a Cache, growing its batch and choosing its device: named errors before anything is allocated, and a
failed call changes nothing."""

import pytest
import torch

from hybridcache.cache import Cache
from hybridcache.cache.core import limits
from hybridcache.cache.core.errors import CacheError, CacheIndexError, CacheIndexTypeError, CacheMemoryError
from hybridcache.cache.core.limits import check_fits, device_problem
from tests.cache.helpers import NATIVE, feed, hybrid_cache, state_equal


@pytest.mark.parametrize("key", [99, 7, -8, -100, 10**30])
def test_an_index_out_of_range_says_how_many_layers(key):
    cache = hybrid_cache()
    with pytest.raises(CacheIndexError, match=r"out of range: this cache has 7 layers \(indices 0 to 6, or -7 to -1"):
        cache[key]
    with pytest.raises(IndexError):  # still an IndexError for code that catches those
        cache[key]


@pytest.mark.parametrize("key", ["x", 1.5, None, True, torch.tensor([1, 2]), (0, 1), [0]])
def test_an_index_of_the_wrong_type_says_what_indexing_accepts(key):
    cache = hybrid_cache()
    with pytest.raises(CacheIndexTypeError, match=r"an int in \[-7, 7\) or a slice; got .*this cache has 7 layers"):
        cache[key]
    with pytest.raises(TypeError):
        cache[key]


def test_what_indexing_accepts():
    cache = hybrid_cache()
    assert cache[0] is cache.entries[0] and cache[-1] is cache.entries[6]
    assert cache[torch.tensor(2)] is cache.entries[2]  # one-element integer tensors index like ints
    assert cache[1:3] == cache.entries[1:3]


@pytest.fixture
def one_gib(monkeypatch):
    """A machine with 1 GiB available (so the tests do not depend on this one's memory)."""
    monkeypatch.setattr(limits, "available_bytes", lambda device: None if str(device) == "meta" else 1 << 30)


@pytest.mark.parametrize(
    "grow",
    [
        lambda c: c.repeat(10**12),
        lambda c: c.repeat(10**30),
        lambda c: c.repeat(10**6),
        lambda c: c.select(torch.zeros(10**6, dtype=torch.long)),
    ],
    ids=["repeat 1e12", "repeat 1e30", "repeat 1e6", "select 1e6 rows"],
)
def test_growing_the_batch_past_memory_is_refused_before_allocating(grow, one_gib):
    cache = hybrid_cache()
    feed(cache, 3)
    before = cache.snapshot()
    with pytest.raises(CacheMemoryError, match="needs at least .* but only .* is available; nothing was allocated"):
        grow(cache)
    assert state_equal(cache.snapshot(), before)
    cache.repeat(2)  # a request that fits still works
    assert cache.batch_size == 4


def test_a_cache_of_too_many_rows_is_refused_before_allocating(one_gib):
    with pytest.raises(CacheMemoryError, match="a cache of 1000000000000 rows needs at least"):
        Cache.build([NATIVE["mamba"], NATIVE["full"]], 10**12)
    with pytest.raises(CacheMemoryError):  # preallocated: 1e5 rows x 4096 slots x 64 bytes
        Cache.build([NATIVE["full"]], 10**5, max_length=4096)
    Cache.build([NATIVE["full"]], 2, max_length=4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process without CUDA")
def test_cuda_without_cuda_is_a_named_error():
    with pytest.raises(CacheError, match="device 'cuda' cannot be used here"):
        Cache.build([NATIVE["full"]], 2, device="cuda")


@pytest.mark.parametrize("device", ["cuda:99", "not-a-device", 3.5])
def test_a_device_that_cannot_be_used_is_a_named_error(device):
    with pytest.raises(CacheError, match="device"):
        Cache.build([NATIVE["full"]], 2, device=device)
    assert device_problem(device)


def test_check_fits_says_what_and_how_much(one_gib):
    check_fits(10, "cpu", "ten bytes")
    check_fits(10**18, "meta", "anything on meta")  # no memory to run out of: not checked
    with pytest.raises(CacheMemoryError, match=r"a huge thing needs at least .* on cpu.*\(ask for less\)"):
        check_fits(10**18, "cpu", "a huge thing", "ask for less")
    with pytest.raises(MemoryError):  # still a MemoryError for code that catches those
        check_fits(10**18, "cpu", "a huge thing")
