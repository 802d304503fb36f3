"""A layer-level storage (cache/storage/grouped_codecs.py: `kivi`, `hf_quantized`) as an attention storage:
`GroupedStorage`.

The `GroupedKVStorage` owns keys and values (columns of the whole batch quantized together); this class answers the
attention storage protocol over it (write / commit / select / crop / restore, validate first and mutate after) and
mirrors the storage's state as tensors: `key_pos` = the held positions [B, S] (what masks are built from) and
`kv_<name>`, so that snapshots, restore, shape checks and persistence handle it like any storage: plain ints / bools
of the state (columns, k_start, v_start, armed) become one-element tensors [1] (persistence hashes bytes: a 0-d
tensor has no byte view), tensors whose dim 0 is the batch are batch tensors, the others (HF's scales, grouped
across rows) are not. It cannot follow an eviction that keeps different slots per row (`take` refuses).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.cache.attention.specs import AttentionSpec
from hybridcache.cache.attention.staging import AttentionWrite, CropPlan, GroupedWrite
from hybridcache.cache.attention.storage.protocol import AttentionStorage, Evict, Take
from hybridcache.cache.attention.view import AttentionView
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.sequence import BlockState
from hybridcache.cache.storage.grouped import GroupedKVStorage

PREFIX = "kv_"


class GroupedStorage(AttentionStorage):
    """Keys and values of one attention cache layer in a layer-level storage (columns of the whole batch together)."""

    def __init__(self, spec: AttentionSpec, codec: Any, storage: GroupedKVStorage, device: torch.device) -> None:
        self.spec, self.codec, self.storage, self.device = spec, codec, storage, device
        self.exact = codec.exact
        self._publish()

    def _publish(self) -> None:
        """Mirror the storage's state as `tensors` (the tensors themselves: the storage never writes them in place)."""
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
        self.tensors, self.batch_names, self.other_names = tensors, ("key_pos", *rows), tuple(other)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.storage.read()

    def nbytes(self) -> int:
        return self.storage.nbytes()

    def write(self, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> tuple[AttentionView, AttentionWrite]:
        """Stage a block (pure: the storage changes at commit); CacheError before anything changes."""
        staged = GroupedWrite(self.storage.prepare(k, v, block.positions), block)
        st = staged.staged
        return AttentionView(st.keys, st.values, block.positions, st.pos, self.spec), staged

    def commit(self, staged: AttentionWrite, evict: Evict | None) -> None:
        """The storage keeps the columns some row's next query can still see (evict None: all), at its own
        granularity."""
        assert isinstance(staged, GroupedWrite)
        keep = None
        if evict is not None:
            seen, visible = staged.block.seen_after[:, None], self.spec.visible  # [B, 1]
            keep = lambda pos: ((pos >= 0) & visible(seen, pos)).any(0)  # noqa: E731
        self.storage.commit(staged.staged, keep)
        self._publish()

    def take(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        raise CacheError(f"storage '{self.codec.name}' keeps whole columns of the batch: it cannot keep slots per row")

    def check_select(self, index: torch.Tensor) -> None:
        """Raise (changing nothing) if the rows cannot be selected apart (HF's axis -1 groups across rows)."""
        self.storage._select_rows(self.storage.state(), index)

    def select(self, index: torch.Tensor) -> None:
        self.storage.select(index)
        self._publish()

    def prepare_crop(self, n: int, plan: CropPlan) -> dict[str, Any]:
        """The storage's state after crop(n) (CacheCropError if it cannot crop exactly)."""
        return self.storage._crop(self.storage.state(), n)

    def crop(self, plan: dict[str, Any], take: Take) -> None:
        self.storage.load_state(plan)
        self._publish()

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back a snapshot's (already checked) mirrored tensors: ints and bools as the storage keeps them."""
        state = {}
        for name, current in self.storage.state().items():
            t = tensors["key_pos" if name == "pos" else PREFIX + name].clone().to(self.device)
            state[name] = t if isinstance(current, torch.Tensor) else type(current)(t.item())
        self.storage.load_state(state)
        self.storage.batch = state["pos"].shape[0]
        self._publish()
