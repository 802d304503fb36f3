"""A layer-level storage behind an attention cache layer (grouped_codecs.py: kivi, hf_quantized): `GroupedSlots`.

The `GroupedKVStorage` owns keys and values; `GroupedSlots` holds it and answers the layer's storage operations
(write / commit / select / crop / restore, validate first and mutate after). The layer keeps `key_pos` = the
storage's held positions [B, S] (what masks are built from) and mirrors the storage's state as layer tensors
`kv_<name>` (`mirror()`), so that the base snapshot, restore, shape checks and persistence handle it like any
storage: plain ints / bools of the state (columns, k_start, v_start, armed) become one-element tensors [1]
(persistence hashes bytes: a 0-d tensor has no byte view), tensors whose dim 0 is the batch are batch tensors, the
others (HF's scales, grouped across rows) are not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.cache.attention.staging import GroupedWrite
from hybridcache.cache.core.sequence import BlockState
from hybridcache.cache.storage.grouped import GroupedKVStorage

PREFIX = "kv_"


@dataclass
class Mirror:
    """The storage's state as layer tensors: `key_pos` [B, S] and `kv_<name>` ones, split into batch / other."""

    tensors: dict[str, torch.Tensor]
    rows: tuple[str, ...]  # dim 0 is the batch
    other: tuple[str, ...]


class GroupedSlots:
    """Keys and values of one attention cache layer in a layer-level storage (columns of the whole batch together)."""

    def __init__(self, storage: GroupedKVStorage, device: torch.device) -> None:
        self.storage = storage
        self.device = device

    def mirror(self) -> Mirror:
        """The storage's state as layer tensors (the tensors themselves: the storage never writes them in place)."""
        tensors, rows, other = {}, [], []
        unbatched = getattr(self.storage, "unbatched", ())
        for name, value in self.storage.state().items():
            if name == "pos":
                tensors["key_pos"] = value  # [B, S]
                continue
            attr = PREFIX + name
            if isinstance(value, torch.Tensor):
                (other if name in unbatched else rows).append(attr)
            else:
                value = torch.tensor([value], device=self.device)  # int -> long, bool -> bool
                other.append(attr)
            tensors[attr] = value
        return Mirror(tensors, tuple(rows), tuple(other))

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage.read()

    def nbytes(self) -> int:
        return self.storage.nbytes()

    def write(self, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> GroupedWrite:
        """Stage a block (pure: the storage changes at commit); CacheError before anything changes."""
        return GroupedWrite(self.storage.prepare(k, v, block.positions), block)

    def commit(self, write: GroupedWrite, visible: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None) -> None:
        """Make the block permanent; `visible(q, kv)` the pattern (None: nothing is evicted). The storage keeps the
        columns some row's next query can still see, at its own granularity."""
        keep = None
        if visible is not None:
            seen = write.block.seen_after[:, None]  # [B, 1]
            keep = lambda pos: ((pos >= 0) & visible(seen, pos)).any(0)  # noqa: E731
        self.storage.commit(write.staged, keep)

    def check_select(self, index: torch.Tensor) -> None:
        """Raise (changing nothing) if the rows cannot be selected apart (HF's axis -1 groups across rows)."""
        self.storage._select_rows(self.storage.state(), index)

    def select(self, index: torch.Tensor) -> None:
        self.storage.select(index)

    def prepare_crop(self, n: int) -> dict[str, Any]:
        """The state after crop(n) (CacheCropError if the storage cannot crop exactly)."""
        return self.storage._crop(self.storage.state(), n)

    def commit_crop(self, state: dict[str, Any]) -> None:
        self.storage.load_state(state)

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back a snapshot's (already checked) mirrored tensors: ints and bools as the storage keeps them."""
        state = {}
        for name, current in self.storage.state().items():
            t = tensors["key_pos" if name == "pos" else PREFIX + name].clone().to(self.device)
            state[name] = t if isinstance(current, torch.Tensor) else type(current)(t.item())
        self.storage.load_state(state)
        self.storage.batch = state["pos"].shape[0]
