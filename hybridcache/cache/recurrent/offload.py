"""`offload: true` on recurrent layers: the held state parts (codes and scales of any `state_codec`, checkpoint
trails included) stay off the compute device between blocks.

It reuses attention's offload tier (cache/storage/offload.py): a model on a GPU parks the parts in pinned CPU memory and
prefetches the next layer's on a side stream while this one computes; a model on the CPU parks them in
memory-mapped, already unlinked files (the kernel may write those pages out under memory pressure instead of
counting them as process memory), so on the CPU it saves resident memory, not bandwidth. The layer fetches the parts
to read `states` (then drops the copy: reading changes nothing), writes the new encoded state straight onto the
parked parts at the commit (a checkpointed layer fetches first, as its trail shifts), and fetches / parks around
batch operations. Exact: the parked parts are the held parts, bit for bit; `nbytes()` counts them.
"""

from __future__ import annotations

from typing import Any

from hybridcache.cache.storage.offload import OffloadTier


def state_tier(layer: Any) -> OffloadTier | None:
    """The tier for a recurrent layer whose spec asks for offload (None: its parts stay on its device; a "meta"
    device holds shapes only, nothing to move)."""
    if not layer.spec.offload or layer.device.type not in ("cpu", "cuda"):
        return None
    return OffloadTier(layer)
