"""`storage: offload`: dense keys and values kept on a slower tier, with next-layer prefetch.

Exact (the payload is the dense tensors, bit for bit) and usable with every attention pattern and layout. A layer
fetches its parts to the compute device for its update (and drops that copy as soon as the attention view is built;
only the block's new keys/values are staged), fetches them again for its commit, which parks the result, and for
batch operations (reorder, crop, ...). So about one layer's parts, plus the one prefetched, are on the compute
device at a time, and none between blocks. Where the parked parts live:
- model on a GPU: in pinned CPU memory. Prefetch issues the next layer's host-to-device copy on a side CUDA stream
  while this layer computes (as HF's OffloadedCache does); the next layer waits on that copy's event instead of
  copying again. Per layer and block: two host-to-device copies (update, commit) and one device-to-host copy (park).
- model on the CPU: in memory-mapped files (`torch.from_file(shared=True)` under $HYBRIDCACHE_OFFLOAD_DIR or the
  system temp dir; each file is unlinked as soon as it is mapped, so nothing is left behind). The pages are file
  backed, so the kernel may write them out under memory pressure instead of counting them as process memory.
  Prefetch reads the next layer's files into ordinary memory before its turn (synchronously, on the same thread),
  so that layer attends over memory, not over pages that may have to be read back from disk.
"Next layer" is learned, not declared: layers fetched one after another on the same sequence state link up (the
last one of a block links to the first one of the next), so any model order and any mix of cache types works; a
prefetched copy is dropped whenever its layer parks (it may be stale). `nbytes()` counts the parked parts (the
dense bytes), not the transient copies. Not for `generation.compile` (the compiled step would capture the parked
tensors).
"""

from __future__ import annotations

import os
import tempfile
import uuid
import weakref
from typing import Any

import torch

from hybridcache.cache.kv_codecs import DenseCodec, register_kv_codec

_LAST: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()  # sequence state -> last fetched


def offload_dir() -> str:
    return os.environ.get("HYBRIDCACHE_OFFLOAD_DIR") or tempfile.gettempdir()


class OffloadTier:
    """One layer's parked parts (`parked`, on the slow tier) and the prefetched copy of them, if any."""

    def __init__(self, layer: Any) -> None:
        self.layer = weakref.ref(layer)
        self.cuda = layer.device.type == "cuda"
        self.parked: dict[str, torch.Tensor] = {}
        self.prefetched: dict[str, torch.Tensor] | None = None
        self.event: Any = None  # CUDA: the prefetch copy's completion
        self.stream: Any = None  # CUDA: the side stream prefetches run on
        self.next: weakref.ref | None = None  # the tier fetched after this one (learned)
        self.prefetch_hits = 0  # fetches served by a prefetched copy

    def _slow(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` on the slow tier."""
        if self.cuda:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        if t.numel() == 0:
            return t.detach().clone()
        path = os.path.join(offload_dir(), f"hybridcache-offload-{uuid.uuid4().hex}.bin")
        mapped = torch.from_file(path, shared=True, size=t.numel(), dtype=t.dtype)
        os.unlink(path)  # the mapping stays valid; the file disappears with it
        return mapped.view(t.shape).copy_(t)

    def _load(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.to(device, non_blocking=True) if self.cuda else t.clone()

    def park(self) -> None:
        layer = self.layer()
        if self.event is not None:  # a prefetch may still be reading the parked tensors
            self.event.synchronize()
            self.event = None
        self.prefetched = None
        for attr in layer._parts:
            t, old = getattr(layer, attr), self.parked.get(attr)
            if t is old:
                continue
            if old is not None and old.shape == t.shape and old.dtype == t.dtype:
                old.copy_(t)  # same layout (preallocated storage): write back in place
            else:
                self.parked[attr] = self._slow(t)
            setattr(layer, attr, self.parked[attr])

    def release(self) -> None:
        """Drop the fetched copy without writing it back (the layer changed nothing since `fetch`)."""
        layer = self.layer()
        for attr, t in self.parked.items():
            setattr(layer, attr, t)

    def fetch(self) -> None:
        layer = self.layer()
        last = _LAST.get(layer.seq)
        if last is not None and last() is not None and last() is not self:
            last().next = weakref.ref(self)  # learn the order: this layer comes after the last one fetched
        _LAST[layer.seq] = weakref.ref(self)
        if self.prefetched is not None:
            parts = self.prefetched
            self.prefetch_hits += 1
            if self.event is not None:
                torch.cuda.current_stream(layer.device).wait_event(self.event)
                for t in parts.values():
                    t.record_stream(torch.cuda.current_stream(layer.device))
        else:  # a copy either way: writes reach the parked parts only when the layer parks
            parts = {attr: t.to(layer.device, copy=True) for attr, t in self.parked.items()}
        for attr, t in parts.items():
            setattr(layer, attr, t)
        self.prefetched, self.event = None, None
        following = self.next() if self.next is not None else None
        if following is not None and following is not self and following.layer() is not None:
            following.prefetch()

    def prefetch(self) -> None:
        """Load the parked parts ahead of `fetch` (GPU: asynchronously on a side stream)."""
        if self.prefetched is not None or not self.parked:
            return
        device = self.layer().device
        if self.cuda:
            self.stream = self.stream or torch.cuda.Stream(device)
            with torch.cuda.stream(self.stream):
                self.prefetched = {attr: self._load(t, device) for attr, t in self.parked.items()}
                self.event = self.stream.record_event()
        else:
            self.prefetched = {attr: self._load(t, device) for attr, t in self.parked.items()}


@register_kv_codec("offload")
class OffloadCodec(DenseCodec):
    """Dense parts on a slower tier (see the module docstring). Exact."""

    exact = True

    def tier(self, layer):
        return OffloadTier(layer) if layer.device.type in ("cpu", "cuda") else None  # "meta": shapes only
