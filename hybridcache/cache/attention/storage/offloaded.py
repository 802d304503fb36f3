"""`storage: offload` as a wrapper: `OffloadedStorage` keeps another storage's parts on a slower tier.

The inner storage (codec.py / static.py) does the work; this wrapper fetches its parts to the compute device around
each operation and parks them after (cache/storage/offload.py's `OffloadTier`: pinned CPU memory with a side-stream
prefetch on a GPU, memory-mapped files on the CPU). A write fetches, stages, checks the tier has room for what the
commit will park, and drops the fetched copy at once (the staged record keeps only the block's own keys / values:
about one layer's parts are on the compute device at a time); the commit fetches again, writes again what the write
put in place (`reapply`), commits and parks. Positions (and a residual window) stay on the compute device.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from hybridcache.cache.attention.staging import AttentionWrite, BlockWrite, DecodeWrite
from hybridcache.cache.attention.storage.codec import CodecStorage
from hybridcache.cache.attention.storage.protocol import AttentionStorage, Evict, Take
from hybridcache.cache.attention.view import AttentionView
from hybridcache.cache.core.sequence import BlockState
from hybridcache.cache.storage.offload import OffloadTier


class _Parked:
    """What an `OffloadTier` works on: the inner storage's parts as attributes (`_parts`), its device, and the
    layer's sequence state (the tier learns the order layers fetch in per sequence)."""

    def __init__(self, inner: CodecStorage, layer: Any) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_layer", weakref.ref(layer))

    @property
    def _parts(self) -> tuple[str, ...]:
        return tuple(self._inner.parts)

    @property
    def device(self) -> torch.device:
        return self._inner.device

    @property
    def seq(self) -> Any:
        return self._layer().seq

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self._inner.tensors[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, t: torch.Tensor) -> None:
        self._inner.tensors[name] = t


class OffloadedStorage(AttentionStorage):
    """Another storage whose codec parts live on a slower tier between operations (see the module docstring)."""

    def __init__(self, inner: CodecStorage, layer: Any) -> None:
        self.inner, self.device, self.exact = inner, inner.device, inner.exact
        self.tensors = inner.tensors  # the same dict: what the tier parks is what the layer shows
        self.batch_names, self.other_names = inner.batch_names, inner.other_names
        self._parked = _Parked(inner, layer)
        self.tier = OffloadTier(self._parked)
        self.tier.park()  # the construction fails as a whole (CacheError) where the tier cannot hold the parts

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read()

    def nbytes(self) -> int:
        return self.inner.nbytes()  # the parked (dense) bytes, not the transient copies

    def release(self) -> None:
        self.tier.release()

    def write(self, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> tuple[AttentionView, AttentionWrite]:
        self.tier.fetch()
        staged = None
        try:
            view, staged = self.inner.write(k, v, block)
            if isinstance(staged, BlockWrite):  # room now for what the commit will park
                self.tier.check_room(dict(zip(self.inner.parts, (view.keys, view.values))))
        except BaseException:
            if staged is not None:
                self.inner.abort(staged)
            self.tier.release()
            raise
        self.tier.release()  # the parked parts are unchanged; the commit fetches them again
        # the staged record must not keep the fetched copy alive: the view's tensors (a block) or what the written
        # slots held (a decode step: written in the copy, the parked parts never changed) are dropped
        if isinstance(staged, BlockWrite):
            staged = dataclasses.replace(staged, keys=None, values=None)
        elif isinstance(staged, DecodeWrite):
            staged = dataclasses.replace(staged, old={})
        return view, staged

    def commit(self, staged: AttentionWrite, evict: Evict | None) -> None:
        self.tier.fetch()
        self.inner.reapply(staged)
        self.inner.commit(staged, evict)
        self.tier.park()

    def abort(self, staged: AttentionWrite) -> None:
        self.inner.abort(staged)
        self.tier.release()

    def take(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        self.inner.take(index, valid)  # (called by the layer's eviction inside `commit` / `crop`: fetched)

    def select(self, index: torch.Tensor) -> None:
        self.tier.fetch()
        self.inner.select(index)
        self.tier.park()

    def prepare_crop(self, n: int, plan: Any) -> Any:
        return self.inner.prepare_crop(n, plan)

    def crop(self, plan: Any, take: Take) -> None:
        self.tier.fetch()
        self.inner.crop(plan, take)
        self.tier.park()

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        self.inner.restore(tensors)  # in place into the parked parts where the layout is the same
        self.tier.park()
