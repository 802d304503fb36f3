"""The protocol every attention storage implements: how an attention cache layer's kept tokens are held.

The layer (layer.py) owns the pattern (its spec) and the eviction policy (`_evict` / `_take`); its storage owns the
tensors and answers the same operations whatever its kind (storage/__init__.py picks one per layer, once):
- `write(k, v, block)` -> (the view the block attends to, a typed staged record, staging.py); nothing the layer
  holds changes visibly until `commit(staged, evict)` (or `abort(staged)` puts back what an in-place write changed);
- `take(index)` keeps some slots (eviction), `select(index)` some batch rows, `crop(plan, take)` drops what a crop
  removes, `restore(tensors)` puts back a snapshot's tensors;
- `tensors`: every stored tensor by name (`keys_data`, `key_pos`, `res_keys`, `kv_*`, ...). The layer shows them as
  its attributes, and saves, snapshots and selects them by these names (the save format).
Capability flags say what a storage can do, instead of checks of its type: `kernel_slots` (a decode kernel may write
tokens into its slots: reserve / append in place), `drops_oldest` (dropping the oldest slots is a view, no copy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from hybridcache.cache.attention.staging import AttentionWrite, CropPlan
from hybridcache.cache.attention.view import AttentionView
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.sequence import BlockState

# what a dynamic storage calls after a block is in (positions [B, (H,) S], the block): the layer's eviction, which
# calls the storage's `take` with the slots to keep
Evict = Callable[[torch.Tensor, BlockState], None]
Take = Callable[[torch.Tensor], None]  # the layer's `_take` (slot state of scored methods follows the slots)


class AttentionStorage(ABC):
    """Keys, values and key positions of one attention cache layer (see the module docstring)."""

    kernel_slots: ClassVar[bool] = False  # a kernel may write decode tokens into the slots (append / reserve)
    drops_oldest: ClassVar[bool] = False  # `drop_oldest(n)` is a view of the newest slots (no copy)
    exact: bool = True  # gives back exactly what it was given
    device: torch.device

    tensors: dict[str, torch.Tensor]  # name -> tensor: everything stored (the layer's attributes of these names)
    batch_names: tuple[str, ...]  # names of `tensors` whose dim 0 is the batch
    other_names: tuple[str, ...] = ()  # the others (bookkeeping without a batch dim)

    @property
    def key_pos(self) -> torch.Tensor:
        """Positions [B, S] (per kv head: [B, H, S]) of the held slots (-1: padding or empty slot)."""
        return self.tensors["key_pos"]

    @abstractmethod
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values [B, H, S, D], decoded."""

    @abstractmethod
    def write(self, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> tuple[AttentionView, AttentionWrite]:
        """Stage a block k, v [B, H, T, D]: the view it attends to and what `commit` / `abort` needs."""

    @abstractmethod
    def commit(self, staged: AttentionWrite, evict: Evict | None) -> None:
        """Make a staged block permanent; `evict` (None: nothing is evicted) is called once the block is in."""

    def abort(self, staged: AttentionWrite) -> None:
        """Drop a staged block (put back what an in-place write changed)."""

    def reapply(self, staged: AttentionWrite) -> None:
        """Write an in-place staged write again into the current tensors (an offload tier dropped the copy it was
        written to); storages that write at commit have nothing to do."""

    # -- only where `kernel_slots` (storage/append.py) -------------------------------------------------------------
    def append(
        self, k: torch.Tensor | None, v: torch.Tensor | None, block: BlockState
    ) -> tuple[AttentionView, AttentionWrite]:
        """`write`, with k and v None: the block's slots left for a kernel to write (or taken as `reserve`'s caller
        wrote them)."""
        raise NotImplementedError

    def reserve(self, tokens: int) -> Any:
        """Room for `tokens` slots after the held ones, for a kernel to write (a `Reserved`, attention/slots.py)."""
        raise NotImplementedError

    def take(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep the slots `index` ([S'] for all rows, [B, S'] per row, [B, H, S'] per row and head); `valid` (same
        shape) False marks a kept slot empty."""
        raise CacheError(f"{type(self).__name__} cannot keep some of its slots")

    def drop_oldest(self, n: int) -> None:
        """Drop the first n slots (only where `drops_oldest`)."""
        raise NotImplementedError

    def check_select(self, index: torch.Tensor) -> None:
        """Raise (changing nothing) if the rows `index` cannot be selected apart."""

    def select(self, index: torch.Tensor) -> None:
        """Keep the batch rows `index` (same length: in place, storage addresses kept)."""
        in_place = index.numel() == self.key_pos.shape[0]
        for name in self.batch_names:
            picked = self.tensors[name].index_select(0, index)
            if in_place:
                self.tensors[name].copy_(picked)
            else:
                self.tensors[name] = picked

    def prepare_crop(self, n: int, plan: CropPlan) -> Any:
        """What `crop` needs to truncate to n columns (validated by the layer: `plan`); raises, changing nothing,
        where the storage cannot crop exactly."""
        return plan

    @abstractmethod
    def crop(self, plan: Any, take: Take) -> None:
        """Drop what a crop removes (the plan of `prepare_crop`); `take` keeps slots as the layer does."""

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back a snapshot's (already checked) tensors, in place where the layout is the same."""
        for name, t in tensors.items():
            current = self.tensors[name]
            if current.shape == t.shape and current.dtype == t.dtype:
                current.copy_(t)  # keep storage addresses stable (static shapes)
            else:
                self.tensors[name] = t.clone().to(self.device)

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of keys and values held (positions excluded)."""

    def spare_nbytes(self) -> int:
        """Bytes allocated beyond what `nbytes()` holds (spare slots appends fill in place)."""
        return 0

    def release(self) -> None:
        """Drop any fetched copy of parts kept elsewhere (offload), unwritten."""
