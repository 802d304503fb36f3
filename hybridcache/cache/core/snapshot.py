"""`CacheSnapshot`: what `Cache.snapshot` takes and `Cache.restore` puts back, and its structural check.

Its own module so that the cache and its file format (persistence.py) both build on it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.core.base import LayerSnapshot
from hybridcache.cache.core.errors import CacheError


@dataclass(frozen=True)
class CacheSnapshot:
    """Deep copies of every layer's storage and of the sequence state; `Cache.restore` puts them back bit-exactly."""

    layers: tuple[LayerSnapshot, ...]
    seen: torch.Tensor
    columns: int
    fingerprint: torch.Tensor | None = None
    history: torch.Tensor | None = None  # [B, columns] running token fingerprint (what crop keeps it by)


def check_cache_snapshot(snap: CacheSnapshot, n_layers: int) -> tuple[int, torch.Tensor]:
    """(columns, seen [B]) of a snapshot for a cache of `n_layers` layers, after checking its structure and that
    every layer snapshot agrees with its sequence state (the tensors' shapes are the layers' own check)."""
    if (
        not isinstance(snap, CacheSnapshot)
        or not isinstance(snap.layers, (tuple, list))
        or len(snap.layers) != n_layers
        or not all(isinstance(s, LayerSnapshot) for s in snap.layers)
    ):
        raise CacheError("restore needs a CacheSnapshot taken from a cache with the same layers")
    columns, seen = snap.columns, snap.seen
    if isinstance(columns, bool) or not isinstance(columns, int) or columns < 0:
        raise CacheError(f"restore: the snapshot's column count must be an int >= 0, got {columns!r}")
    if (
        not isinstance(seen, torch.Tensor)
        or seen.dim() != 1
        or seen.dtype != torch.long
        or not len(seen)
        or seen.is_meta
        or bool(((seen < 0) | (seen > columns)).any())
    ):
        raise CacheError(
            f"restore: the snapshot's real-token counts must be a LongTensor [B] in [0, {columns}], got {seen!r}"
        )
    for name, t in (("fingerprint", snap.fingerprint), ("history", snap.history)):
        want = (len(seen),) if name == "fingerprint" else (len(seen), columns)
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != want):
            raise CacheError(f"restore: the snapshot's token {name} must have shape {want}")
    for i, s in enumerate(snap.layers):
        if s.columns != columns or not torch.equal(s.seen, seen):
            raise CacheError(f"snapshot layer {i} disagrees with the snapshot's sequence state")
    return columns, seen
