"""Recurrent cache layers in a decode run (Cache.reserve_decode / feed_reserved; recurrent/run_states.py): n steps
that a caller runs in the run's own state buffers, then fed as one block, leave the cache exactly as n one-token
blocks would (the states, the checkpoint trail, the positions, the token fingerprint). The oracle is the same
steps fed one block each through `update`. A run the layers cannot take exactly is declined; an abandoned run
leaves the cache as it was."""

import pytest
import torch

from hybridcache.cache import Cache, NativeLayer
from tests.cache.helpers import NATIVE, state_equal

RECURRENT = ("mamba", "mamba2", "rglru", "conv")


def _cache(config=None, batch=2):
    return Cache.build([NATIVE[t] for t in RECURRENT], batch, config)


def _next(states: dict, step: int, index: int) -> dict:
    """A step's new states from the states before it (any function of them: the test's stand-in for a kernel)."""
    return {n: torch.sin(t * 1.3 + 0.1 * step + index) for n, t in states.items()}


def _stepwise(cache, ids, start):
    for j in range(ids.shape[1]):
        cache.begin_block(None, 1, ids=ids[:, j : j + 1])
        for i, layer in enumerate(cache.layers):
            layer.update(**_next(layer.states, start + j, i))
        cache.end_block()


def _run(cache, ids, start, reserve=None):
    reserved = cache.reserve_decode(reserve or ids.shape[1])
    assert reserved is not None
    for j in range(ids.shape[1]):
        for i, r in enumerate(reserved):
            for name, t in _next(r.read(j), start + j, i).items():
                r.write(j)[name].copy_(t)
    cache.feed_reserved(ids)


def _ids(batch, n, seed):
    return torch.randint(0, 50, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rollback", [0, 1, 3])
@pytest.mark.parametrize("steps", [[1], [5], [2, 4, 1]])
def test_a_run_is_n_one_token_blocks(rollback, steps):
    config = {"recurrent": {"rollback": rollback}} if rollback else None
    run, want = _cache(config), _cache(config)
    prompt = _ids(2, 3, 0)
    for c in (run, want):
        _stepwise(c, prompt, 0)
    start = 3
    for k, n in enumerate(steps):
        ids = _ids(2, n, k + 1)
        _run(run, ids, start, reserve=n + 2)  # (fewer steps than reserved)
        _stepwise(want, ids, start)
        start += n
        assert state_equal(run.snapshot(), want.snapshot())
        assert torch.equal(run.seq.fingerprint, want.seq.fingerprint)
        assert torch.equal(run.seq.history(), want.seq.history())
    if rollback:  # the trail rewinds as far as the step-by-step one
        run.crop(start - rollback)
        want.crop(start - rollback)
        assert state_equal(run.snapshot(), want.snapshot())


def test_an_abandoned_run_leaves_the_cache_as_it_was():
    cache = _cache({"recurrent": {"rollback": 2}})
    _stepwise(cache, _ids(2, 4, 0), 0)
    before = cache.snapshot()
    reserved = cache.reserve_decode(3)
    for j in range(2):
        for i, r in enumerate(reserved):
            for name, t in _next(r.read(j), j, i).items():
                r.write(j)[name].copy_(t)
    cache.feed_reserved(None)
    assert state_equal(cache.snapshot(), before)
    assert all(layer.__dict__.get("_run_states") is None for layer in cache.layers)  # its buffers let go
    _stepwise(cache, _ids(2, 1, 1), 4)  # free, and feeds as before


@pytest.mark.parametrize(
    "config",
    [
        {"recurrent": {"state_codec": "int8"}},
        {"recurrent": {"state_codec": "bfloat16"}},
        {"recurrent": {"state_dtype": torch.float64}},
        {"recurrent": {"offload": True}},
    ],
)
def test_declined_where_one_block_could_differ(config):
    """A lossy codec (re-encoded per block), another state dtype, offloaded states: no run (None, cache free)."""
    cache = _cache(config)
    _stepwise(cache, _ids(2, 2, 0), 0)
    before = cache.snapshot()
    assert cache.reserve_decode(4) is None
    assert state_equal(cache.snapshot(), before)
    _stepwise(cache, _ids(2, 1, 1), 2)  # not held


def test_the_layer_refuses_a_block_it_did_not_reserve():
    layer = Cache.build([NativeLayer("mamba2", NATIVE["mamba2"].params)], 1)[0]
    assert layer.decode_block() is None  # no block open
    assert layer.reserve_slots(0) is None and layer.reserve_slots(True) is None
