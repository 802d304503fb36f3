"""The conformance kit's shared parts: the error, seeded cases, refusal checks (see hybridcache.testing)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridcache.cache import Cache, CacheError, NativeLayer

ATTENTION_SHAPES = {"num_kv_heads": 2, "head_dim": 8}
EXACT_TOL = 1e-9  # float64


class ConformanceError(AssertionError):
    """A cache type broke the contract; the message names the check, the type and the case."""


def _fail(where: str, message: str) -> None:
    raise ConformanceError(f"{where}: {message}")


def _snapshot_equal(a, b) -> bool:
    if a.columns != b.columns or not torch.equal(a.seen, b.seen) or len(a.layers) != len(b.layers):
        return False
    for x, y in zip(a.layers, b.layers):
        if x.tensors.keys() != y.tensors.keys():
            return False
        for n in x.tensors:
            if x.tensors[n].shape != y.tensors[n].shape or not torch.equal(x.tensors[n], y.tensors[n]):
                return False
    return True


class _Kit:
    def __init__(self, name: str, cls, native: dict, params: dict, seed: int) -> None:
        self.name, self.cls, self.native, self.params = name, cls, native, params
        self.g = torch.Generator().manual_seed(seed)
        self.counts: dict[str, int] = {}

    def count(self, check: str) -> None:
        self.counts[check] = self.counts.get(check, 0) + 1

    def cache(self, batch: int, max_length: int | None, dtype=torch.float64) -> Cache:
        spec_params = {**self.native, "dtype": dtype}
        config = {
            "layers": {0: {"type": self.name, **self.params, **({"max_length": max_length} if max_length else {})}}
        }
        return Cache.build([NativeLayer(self.native_type, spec_params)], batch, config)

    def randint(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=self.g))

    def splits(self, n: int) -> list[int]:
        """Block boundaries 0 < ... < n: a prefill then decode steps, or random cuts."""
        if self.randint(0, 1):
            first = self.randint(1, n)
            return [0, *range(first, n + 1)] if first < n else [0, n]
        cuts = sorted({self.randint(1, n - 1) for _ in range(self.randint(0, n - 1))}) if n > 1 else []
        return [0, *cuts, n]

    def pads_mask(self, batch: int, n: int) -> torch.Tensor:
        mask = torch.ones(batch, n, dtype=torch.bool)
        for b in range(1, batch):  # row 0 unpadded, the others padded by up to n-1 columns
            mask[b, : self.randint(0, n - 1)] = False
        return mask

    def expect_refusal(self, where: str, cache: Cache, call: Callable[[], Any], error=CacheError) -> None:
        before = cache.snapshot()
        try:
            call()
        except error:
            pass
        else:
            _fail(where, "a bad call was accepted")
        if not _snapshot_equal(cache.snapshot(), before):
            _fail(where, "a refused call changed the cache")
        self.count("atomic failures")
