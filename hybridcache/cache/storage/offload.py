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

A full disk (or a quota, a file size limit): each file is written with write(2), which reports ENOSPC / EFBIG /
EDQUOT, before it is mapped (writing a sparse file through its mapping would kill the process with SIGBUS instead),
and a file that cannot be written is removed. A layer's update checks first that the directory has room for what
its commit will park (`check_room`: the block is refused with a CacheError, the cache unchanged); a part that still
cannot be parked at the commit (a shortfall the directory did not show in advance) stays in memory on the layer's
device, with an OffloadNotice, so that a commit never fails half way. A layer's construction that cannot park
fails with a CacheError.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.storage.codecs import DenseCodec, register_kv_codec

_LAST: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()  # sequence state -> last fetched
# sequence state -> (the open block, bytes its layers' updates have claimed so far in check_room)
_CLAIMED: weakref.WeakKeyDictionary[Any, tuple[Any, int]] = weakref.WeakKeyDictionary()


class OffloadNotice(UserWarning):
    """A part that could not be parked on the slow tier at a commit stays in memory on the layer's device."""


def offload_dir() -> str:
    return os.environ.get("HYBRIDCACHE_OFFLOAD_DIR") or tempfile.gettempdir()


def _same_layout(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.shape == b.shape and a.dtype == b.dtype


def _why(e: BaseException) -> str:
    """The OS's reason, lower case ("no space left on device"), or the first line of torch's message."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror[0].lower() + e.strerror[1:]
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def _file_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor `t` in a fresh memory-mapped file under offload_dir(), unlinked once mapped. The bytes
    are written with write(2) first, so a full disk is an OSError here, never a SIGBUS through the mapping; on any
    failure the file is removed."""
    directory = offload_dir()
    path = os.path.join(directory, f"hybridcache-offload-{uuid.uuid4().hex}.bin")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    data = memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
    fd = None
    try:
        fd = os.open(path, flags, 0o600)
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])  # a short write, then ENOSPC (or EFBIG, EDQUOT) on the next
        mapped = torch.from_file(path, shared=True, size=t.numel(), dtype=t.dtype)
    except (OSError, RuntimeError, ValueError) as e:
        raise CacheError(
            f"offload storage: cannot park {len(data)} bytes in {directory}: {_why(e)} (set HYBRIDCACHE_OFFLOAD_DIR "
            "to a directory with room)"
        ) from None
    finally:
        if fd is not None:  # ours (O_EXCL): mapped, or failed; either way the name goes
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return mapped.view(t.shape)


class OffloadTier:
    """One layer's parked parts (`parked`, on the slow tier) and the prefetched copy of them, if any. `layer`: what
    holds the parts as attributes named by its `_parts`, with a `device` and a `seq` (a recurrent cache layer; an
    attention layer's `OffloadedStorage` passes a view of the storage it wraps)."""

    def __init__(self, layer: Any) -> None:
        self.layer = weakref.ref(layer)
        self.cuda = layer.device.type == "cuda"
        self.parked: dict[str, torch.Tensor] = {}
        self.prefetched: dict[str, torch.Tensor] | None = None
        self.event: Any = None  # CUDA: the prefetch copy's completion
        self.stream: Any = None  # CUDA: the side stream prefetches run on
        self.next: weakref.ref | None = None  # the tier fetched after this one (learned)
        self.prefetch_hits = 0  # fetches served by a prefetched copy
        self.started = False  # parked once: from then on a park is part of a commit, which must not fail

    def _slow(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` on the slow tier (CacheError, nothing left behind, where it cannot be made)."""
        if self.cuda:
            try:
                return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
            except RuntimeError as e:
                nbytes = t.numel() * t.element_size()
                raise CacheError(f"offload storage: cannot pin {nbytes} bytes of CPU memory: {_why(e)}") from None
        if t.numel() == 0:
            return t.detach().clone()
        return _file_copy(t)

    def check_room(self, parts: Mapping[str, torch.Tensor]) -> None:
        """Refuse (CacheError) an update whose commit will park `parts` (attribute -> the tensor it becomes) where the
        offload directory has no room for them, counting what this block's other layers claimed; called before the
        update changes anything. (Pinned CPU memory, the GPU case, is not checked here.)"""
        sizes = [t.numel() * t.element_size() for a, t in parts.items() if not _same_layout(self.parked.get(a), t)]
        if self.cuda or not any(sizes):
            return
        directory = offload_dir()
        try:
            st = os.statvfs(directory)
            if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
                raise NotADirectoryError(0, "not a directory this process can write to")
        except (OSError, ValueError) as e:
            raise CacheError(f"offload storage: the offload directory {directory} is unusable ({_why(e)})") from None
        unit = st.f_frsize or st.f_bsize or 1
        need = sum(-(-n // unit) * unit for n in sizes)  # whole blocks per file
        seq = self.layer().seq
        block, claimed = _CLAIMED.get(seq, (None, 0))
        claimed = claimed if block is not None and block is seq.block else 0
        free = st.f_bavail * st.f_frsize
        if claimed + need > free:
            raise CacheError(
                f"offload storage: no space left on device at {directory}: this block's keys and values need "
                f"{claimed + need} bytes there, {free} are free (set HYBRIDCACHE_OFFLOAD_DIR to a directory with room)"
            )
        _CLAIMED[seq] = (seq.block, claimed + need)

    def _load(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.to(device, non_blocking=True) if self.cuda else t.clone()

    def park(self) -> None:
        layer = self.layer()
        if self.event is not None:  # a prefetch may still be reading the parked tensors
            self.event.synchronize()
            self.event = None
        self.prefetched = None
        fresh = {}  # every new slow-tier copy first: a failure leaves the parked parts as they were
        for attr in layer._parts:
            t = getattr(layer, attr)
            if t is not self.parked.get(attr) and not _same_layout(self.parked.get(attr), t):
                try:
                    fresh[attr] = self._slow(t)
                except CacheError as e:
                    if not self.started:  # the layer's construction: it fails as a whole
                        raise
                    # a commit (the other layers may have committed already): keep this part where it is
                    warnings.warn(f"hybridcache: {e}; it stays in memory on {t.device}", OffloadNotice, stacklevel=2)
                    fresh[attr] = t
        for attr in layer._parts:
            t, old = getattr(layer, attr), self.parked.get(attr)
            if attr in fresh:
                self.parked[attr] = fresh[attr]
            elif t is not old:
                old.copy_(t)  # same layout (preallocated storage): write back in place
            setattr(layer, attr, self.parked[attr])
        self.started = True

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
    offloads = True  # the layer's storage is wrapped in an OffloadedStorage (cache/attention/storage/offloaded.py)
