"""Bad input raises a clear error naming the problem, and leaves the cache exactly as it was."""

import re
from dataclasses import replace

import pytest
import torch

from hybridcache.cache import CacheError
from tests.cache.helpers import feed, hybrid_cache, in_block, state_equal

# layer indices in hybrid_cache(): 0 full, 1 sliding, 2 chunked, 3 mamba, 4 mamba2, 5 rglru, 6 conv
kv = lambda *shape, **kw: torch.randn(*shape, **kw)  # noqa: E731
STATE = lambda c, i: {n: torch.zeros_like(t) for n, t in c[i].states.items()}  # noqa: E731


def _mixed_batch_snapshot(c):
    """A snapshot of `c` whose first layer's tensors come from a cache of batch 3."""
    snap, other = c.snapshot(), hybrid_cache(batch=3, max_length=16).snapshot()
    first = replace(other.layers[0], seen=snap.seen, columns=snap.columns)
    return replace(snap, layers=(first, *snap.layers[1:]))


B = in_block  # B(cache, tokens, call, valid=None): call() inside one block of the cache

BAD = {
    "keys of rank 3": (lambda c: B(c, 1, lambda: c[0].update(kv(2, 2, 4), kv(2, 2, 4))), "4 dims"),
    "keys not a tensor": (lambda c: B(c, 1, lambda: c[0].update([[1.0]], kv(2, 2, 1, 4))), "must be a tensor"),
    "batch mismatch": (lambda c: B(c, 1, lambda: c[0].update(kv(3, 2, 1, 4), kv(3, 2, 1, 4))), "batch size 3"),
    "heads mismatch": (lambda c: B(c, 1, lambda: c[1].update(kv(2, 3, 1, 4), kv(2, 3, 1, 4))), "3 heads"),
    "head_dim mismatch": (lambda c: B(c, 1, lambda: c[2].update(kv(2, 2, 1, 8), kv(2, 2, 1, 8))), "head_dim 8"),
    "dtype mismatch": (
        lambda c: B(c, 1, lambda: c[0].update(kv(2, 2, 1, 4).double(), kv(2, 2, 1, 4).double())),
        "dtype torch.float64",
    ),
    "device mismatch": (
        lambda c: B(c, 1, lambda: c[0].update(kv(2, 2, 1, 4, device="meta"), kv(2, 2, 1, 4, device="meta"))),
        "on meta",
    ),
    "keys/values differ": (lambda c: B(c, 2, lambda: c[0].update(kv(2, 2, 2, 4), kv(2, 2, 1, 4))), "differ in shape"),
    "block length differs": (
        lambda c: B(c, 1, lambda: c[0].update(kv(2, 2, 2, 4), kv(2, 2, 2, 4))),
        "open block has 1",
    ),
    "fed twice": (
        lambda c: B(c, 1, lambda: [c[0].update(kv(2, 2, 1, 4), kv(2, 2, 1, 4)) for _ in range(2)]),
        "already fed",
    ),
    "not every layer fed": (lambda c: B(c, 1, lambda: c[0].update(kv(2, 2, 1, 4), kv(2, 2, 1, 4))), "were not fed"),
    "fed outside a block": (lambda c: c[0].update(kv(2, 2, 1, 4), kv(2, 2, 1, 4)), "belongs to a Cache"),
    "layer op on a member": (lambda c: c[0].reorder([1, 0]), "call cache.reorder"),
    "empty block": (lambda c: B(c, 0, lambda: None), "at least one token"),
    "mask shape": (lambda c: B(c, 2, lambda: None, torch.ones(2, 3, dtype=torch.long)), "shape"),
    "mask not 0/1": (lambda c: B(c, 2, lambda: None, torch.full((2, 2), 2)), "only 0 and 1"),
    "mask of floats": (lambda c: B(c, 2, lambda: None, torch.full((2, 2), 0.5)), "bool or an integer"),
    "right padding": (lambda c: B(c, 2, lambda: None, torch.tensor([[1, 0], [1, 1]])), "left padding"),
    "padding after real tokens": (lambda c: B(c, 1, lambda: None, torch.tensor([[0], [1]])), "cannot contain padding"),
    "past max_length": (lambda c: B(c, 20, lambda: None), "max_length=16"),
    "negative crop": (lambda c: c.crop(-1), ">= 0"),
    "crop beyond length": (lambda c: c.crop(99), "only 5"),
    "crop a recurrent layer back": (lambda c: c.crop(2), "snapshot"),
    "reorder index out of range": (lambda c: c.reorder([0, 2]), "out of range"),
    "reorder index wrong length": (lambda c: c.reorder([0]), "1 entries for a batch of 2"),
    "reorder float index": (lambda c: c.reorder(torch.tensor([0.0, 1.0])), "integer"),
    "reorder list of floats": (lambda c: c.reorder([0.0, 1.5]), "integer"),
    "select bool index": (lambda c: c.select([True, False]), "integer"),
    "select empty": (lambda c: c.select([]), "empty"),
    "repeat zero": (lambda c: c.repeat(0), "positive integer"),
    "state shape": (
        lambda c: B(c, 1, lambda: c[3].update(conv=torch.zeros(2, 6, 4), ssm=torch.zeros(2, 6, 3))),
        "shape (2, 6, 3)",
    ),
    "state missing": (lambda c: B(c, 1, lambda: c[5].update(conv=torch.zeros(2, 5, 3))), "exactly the states"),
    "state dtype": (
        lambda c: B(c, 1, lambda: c[6].update(conv=torch.zeros(2, 5, 2, dtype=torch.float64))),
        "dtype torch.float32",
    ),
    "restore foreign snapshot": (lambda c: c.restore(hybrid_cache(batch=1, types=("full",)).snapshot()), "same layers"),
    "restore snapshot of another type": (
        lambda c: c.restore(replace(c.snapshot(), layers=tuple(reversed(c.snapshot().layers)))),
        "snapshot was taken from",
    ),
    "restore snapshot whose layers disagree on the batch": (lambda c: c.restore(_mixed_batch_snapshot(c)), "3 rows"),
    "restore snapshot with a state of another shape": (
        lambda c: c.restore(_reshaped_snapshot(c)),
        r"tensor 'ssm' has shape (2, 6, 4), this layer stores [B, 6, 3]",
    ),
    "restore snapshot that saw more tokens than columns": (
        lambda c: c.restore(replace(c.snapshot(), seen=torch.tensor([9, 9]))),
        "in [0, 5]",
    ),
    "restore snapshot with a float column count": (lambda c: c.restore(replace(c.snapshot(), columns=5.0)), "int >= 0"),
    "cache operation while this thread feeds a block": (lambda c: B(c, 1, c.reset), "a block is being fed"),
}


def _reshaped_snapshot(c):
    """A snapshot of `c` whose mamba layer (3) holds an SSM state with another state size (a hand-made file)."""
    snap = c.snapshot()
    layer = snap.layers[3]
    wrong = replace(layer, tensors={**layer.tensors, "ssm": torch.zeros(2, 6, 4)})
    return replace(snap, layers=(*snap.layers[:3], wrong, *snap.layers[4:]))


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_and_changes_nothing(case):
    call, message = BAD[case]
    cache = hybrid_cache(batch=2, max_length=16)
    feed(cache, 5, valid=torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
    before = cache.snapshot()
    with pytest.raises(CacheError, match=re.escape(message)):
        call(cache)
    assert state_equal(cache.snapshot(), before), f"{case} changed the cache"


def test_atomic_across_layers_when_a_later_layer_refuses():
    """Cache.crop validates every layer first: the attention layers may crop, the mamba layer may not."""
    cache = hybrid_cache(batch=2, types=("full", "full", "mamba"))
    feed(cache, 6)
    before = cache.snapshot()
    with pytest.raises(CacheError):
        cache.crop(3)
    assert state_equal(cache.snapshot(), before)


@pytest.mark.parametrize("batch", [0, True, 1.5, "2"])
def test_batch_size_must_be_a_positive_int(batch):
    with pytest.raises(CacheError, match="batch_size must be a positive integer"):
        hybrid_cache(batch=batch)
