"""Attention cache layers: `full`, `sliding`, `chunked` (and the base that new patterns subclass).

A layer is a pattern (its spec: which earlier tokens a query sees, `visible`; preallocated slots, `slot_of`), a
storage (`self.storage`, chosen once at construction by `make_storage`, storage/__init__.py: dense appended in
place, static slots, a per-token codec with an optional residual window, a layer-level grouped format, or any of
these offloaded) and an eviction policy (`_evict` / `_take`: by default what some row's next query can still see;
score-based methods override them). The layer validates, opens blocks and evicts; every storage operation is the
storage's (write / commit / abort / take / select / crop / restore), never a branch on its kind here.

Storage is per slot: keys and values [B, H, S, ...] plus `key_pos`, the position each slot holds (-1: empty or
padding): [B, S] shared by a row's heads, or [B, H, S] per kv head for patterns that keep different tokens per head
(`spec.per_head`: kvpress's scorer presses). Masks come from the spec's pattern and these positions alone. The
storage's tensors are the layer's attributes by name (`keys_data`, `key_pos`, `res_keys`, `kv_*`, ...): saved,
snapshotted and selected under these names. What `update` stages for the open block is a typed record
(staging.py); what a layer class can do is declared by class flags (`own_eviction`, `kernel_writes_slots`, ...;
docs/adding_cache_type.md), what a storage can do by its own (`kernel_slots`, `drops_oldest`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from hybridcache.cache.attention.slots import Reserved
from hybridcache.cache.attention.specs import AttentionSpec, ChunkedSpec, FullSpec, SlidingSpec
from hybridcache.cache.attention.staging import AttentionWrite, CropPlan
from hybridcache.cache.attention.storage import AttentionStorage, make_storage
from hybridcache.cache.attention.view import AttentionView, _per_row, check_kv
from hybridcache.cache.core.base import CacheLayer
from hybridcache.cache.core.errors import CacheCropError, CacheError
from hybridcache.cache.core.registry import register_cache_layer
from hybridcache.cache.core.sequence import BlockState


class AttentionCacheLayer(CacheLayer):
    """Keys and values under a visibility pattern given by the spec, held by a storage chosen from the spec's codec.

    Subclasses change the pattern through their spec, and which tokens a dynamic layer keeps through `_evict`.
    A layer that sets `wants_attention_weights` gets the block's attention weights in `observe_attention`
    (score-based eviction such as H2O / TOVA).
    """

    kind = "attention"
    spec_cls = AttentionSpec
    evicts: ClassVar[bool] = True  # False for patterns where every earlier token stays visible
    wants_attention_weights: ClassVar[bool] = False
    supports_preallocation: ClassVar[bool] = True  # False: the spec refuses max_length (data-dependent slots)
    # capabilities a subclass declares (and gives up by defining the hook they depend on, unless it says otherwise):
    own_eviction: ClassVar[bool] = False  # `_evict` keeps a subset of its own choosing, not what the pattern sees
    kernel_writes_slots: ClassVar[bool] = True  # a decode kernel may write tokens into the slots (False: own `update`)
    spec: AttentionSpec
    storage: AttentionStorage

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_evict" in vars(cls) and "own_eviction" not in vars(cls):
            cls.own_eviction = True  # the pattern-only shortcuts of `_evict_block` must not skip it
        if "update" in vars(cls) and "kernel_writes_slots" not in vars(cls):
            cls.kernel_writes_slots = False  # it feeds its own way: a kernel must not write around it

    # -- storage -----------------------------------------------------------------------------------------------
    def _allocate(self, batch_size: int) -> None:
        self.storage = make_storage(self, batch_size)

    def __getattr__(self, name: str) -> torch.Tensor:
        """The storage's tensors by name (`keys_data`, `key_pos`, `res_keys`, `kv_columns`, ...)."""
        storage = self.__dict__.get("storage")
        if storage is not None and name in storage.tensors:
            return storage.tensors[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def _batch_tensors(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.storage.batch_names

    @property
    def _other_tensors(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.storage.other_names

    def _own_tensors(self) -> tuple[str, ...]:
        """Batch tensors of the layer itself, not of its storage (scored methods' slot state, ...)."""
        return tuple(name for name in self._batch_tensors if name not in self.storage.tensors)

    def nbytes(self) -> int:
        return self.storage.nbytes()

    def spare_nbytes(self) -> int:
        """Bytes of spare slots after the held ones (dynamic dense storage appends into them in place)."""
        return self.storage.spare_nbytes()

    @property
    def codec(self) -> Any:
        return self.storage.codec

    @property
    def is_exact(self) -> bool:
        return self.exact and self.storage.exact

    @property
    def static(self) -> bool:
        return self.spec.max_length is not None

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values [B, H, S, D], decoded (the stored tensors themselves for dense storage), with
        the residual window's tokens unquantized."""
        return self.storage.read()

    @property
    def keys(self) -> torch.Tensor:  # for dense storage, the stored tensor itself
        return self.read()[0]

    @property
    def values(self) -> torch.Tensor:
        return self.read()[1]

    def key_positions(self) -> torch.Tensor:
        """Positions [B, S] (per kv head: [B, H, S]) of the held keys (-1: padding or empty slot)."""
        return self.storage.key_pos

    # -- update ------------------------------------------------------------------------------------------------
    def check_capacity(self, seen_after: torch.Tensor) -> None:
        limit = self.spec.max_length
        if limit is not None and bool((seen_after > limit).any()):
            raise CacheError(
                f"{self.name}: a row would hold {int(seen_after.max())} tokens, more than the preallocated "
                f"max_length={limit}; build the cache with a larger max_length"
            )

    def update(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | int | None = None) -> AttentionView:
        """Add a block k, v [B, H, T, D]; returns everything the block must attend to, with positions.

        Inside a Cache the block (its mask and positions) was opened by the Cache; a standalone layer takes the
        block's real-token mask here (`valid` [B, T]; None or T = all real).
        """
        tokens = check_kv(self.name, self.spec, self.batch_size, self.device, k, v)
        block, opened = self._open(valid, tokens)
        try:
            view, self._staged = self.storage.write(k, v, block)
        except BaseException:
            self._close(opened, failed=True)
            raise
        self._close(opened, failed=False)
        return view

    # -- slots a kernel writes itself ---------------------------------------------------------------------------
    # A decode kernel (accel/mixers/attention.py's one-call attention, the many-layer call) writes a token's keys and
    # values straight into the slot the layer reserves, instead of handing them to `update`: `decode_slot` reserves
    # the open one-token block's slot. A decode run (accel/runs/decode_run.py) reserves room for many tokens before any
    # block is open (`reserve_slots`), writes them step by step, and then feeds them as one block whose slots are
    # taken as written (`decode_block`). Only a storage with `kernel_slots` (dense float32 appended in place,
    # storage/append.py), under a pattern the kernel evaluates itself, qualifies (`writes_slots`); anything else is
    # fed through `update`.
    def writes_slots(self) -> bool:
        """Whether a kernel may write decode tokens' keys and values into this layer's slots itself: a storage with
        `kernel_slots`, float32, a pattern the decode kernel evaluates, nothing staged, no attention weights read,
        a layer class that declares `kernel_writes_slots` (one that feeds its own way does not). An open block must
        be all real tokens too."""
        block = self.seq.block
        return not (
            not self.storage.kernel_slots
            or self._staged is not None
            or (block is not None and not block.all_real)
            or self.spec.dtype != torch.float32
            or self.spec.kernel_pattern() is None
            or self.wants_attention_weights
            or not self.kernel_writes_slots
        )

    def decode_slot(self) -> tuple[AttentionView, int] | None:
        """For a kernel that writes a decode token's keys and values itself (accel/mixers/attention.py): the view the
        Cache's open block attends to and the slot (along dim 2 of its keys / values) left for the caller to write,
        the token's position already in the view's key positions. The caller must write that slot of every row
        before the view is read (or the block is aborted: the slot is never part of what the layer holds until the
        commit). None, changing nothing, where the layer needs `update`: a block that is not one real token per
        row, or see `writes_slots`."""
        block = self.seq.block
        if block is None or block.tokens != 1 or not self.writes_slots():
            return None
        view, self._staged = self.storage.append(None, None, block)
        return view, view.keys.shape[2] - 1

    def reserve_slots(self, tokens: int) -> Reserved | None:
        """For a decode that runs up to `tokens` steps before it feeds them as one block (accel/runs/decode_run.py):
        room
        for them right after the held slots. None (nothing changed) where the layer needs `update` or a block is
        open. What the layer holds does not change (its tensors may become views of new buffers with the same
        values). The caller writes slots [end, end + n) of every row and then feeds a block of those n tokens,
        which `decode_block` hands out as written; anything else the layer does before (a block fed through
        `update`, a crop, a restore) ends the reservation (the written slots never become visible: a later append
        starts from what it holds)."""
        if self.seq.block is not None or not self.writes_slots() or tokens < 1:
            return None
        return self.storage.reserve(tokens)

    def decode_block(self) -> AttentionView | None:
        """The open block's view with its tokens' slots taken as they are: the n slots after the held ones that the
        caller of `reserve_slots` wrote (the tokens' positions written into key_pos here). None, changing nothing,
        where the layer needs `update`."""
        block = self.seq.block
        if block is None or not self.writes_slots():
            return None
        view, self._staged = self.storage.append(None, None, block)
        return view

    # -- commit / abort / eviction -------------------------------------------------------------------------------
    def _commit_staged(self, staged: AttentionWrite) -> None:
        self.storage.commit(staged, self._evict_block if self.evicts else None)

    def _abort_staged(self, staged: AttentionWrite) -> None:
        self.storage.abort(staged)

    def _evict_block(self, pos: torch.Tensor, block: BlockState) -> None:
        """After a dynamic storage took a block in (it holds positions `pos` now): keep what the policy keeps."""
        # a pattern of a kernel form (full, sliding, chunked; declared equal to `visible`) keeps a suffix of the
        # slots: positions grow along the slots in every row, and what a query sees of them is a suffix
        form = self.spec.kernel_pattern() if not self.own_eviction else None
        if form is not None and form[0] == "sliding" and pos.shape[1] <= block.most_seen_after < form[1]:
            # the row that saw the most holds a real token in every one of the S held columns (its last S), all
            # still inside its window: nothing can be evicted yet (no per-step eviction ops before the window fills)
            return
        if form is not None and self.storage.drops_oldest:
            # count the suffix some row's next query still sees, drop the rest as a view
            keep = int(((pos >= 0) & self.spec.keeps(block.seen_after[:, None], pos)).any(0).sum())
            if keep < pos.shape[1]:
                self.storage.drop_oldest(pos.shape[1] - keep)
            return
        index = self._evict(pos, block.seen_after)
        if index is not None:
            self._take(index)

    def _evict(self, pos: torch.Tensor, seen: torch.Tensor) -> torch.Tensor | None:
        """Slots to keep after a block ([S'] for all rows or [B, S'] per row); None keeps everything.

        Default: the slots some row's next query (at position `seen`) can still see.
        """
        keep = ((pos >= 0) & self.spec.keeps(_per_row(seen, pos), pos)).flatten(0, -2).any(0)  # [S]
        return None if bool(keep.all()) else keep.nonzero().squeeze(1)

    def _take(self, index: torch.Tensor) -> None:
        """Keep the slots `index` (see `_evict`)."""
        self.storage.take(index)

    # -- batch operations ----------------------------------------------------------------------------------------
    def _prepare_index(self, index: Any, same_size: bool) -> torch.Tensor:
        index = super()._prepare_index(index, same_size)
        self.storage.check_select(index)
        return index

    def _commit_index(self, index: torch.Tensor) -> None:
        self.storage.select(index)
        in_place = index.numel() == self.batch_size  # keep storage addresses stable (static shapes)
        for name in self._own_tensors():
            t, picked = getattr(self, name), getattr(self, name).index_select(0, index)
            if in_place:
                t.copy_(picked)
            else:
                setattr(self, name, picked)

    def _commit_restore(self, snap: Any) -> None:
        self.storage.restore({name: t for name, t in snap.tensors.items() if name in self.storage.tensors})
        for name, t in snap.tensors.items():
            if name in self.storage.tensors:
                continue
            current = getattr(self, name)
            if current.shape == t.shape and current.dtype == t.dtype:
                current.copy_(t)
            else:
                setattr(self, name, t.clone().to(self.device))

    # -- crop ------------------------------------------------------------------------------------------------
    def _prepare_crop(self, n: int, seen: torch.Tensor) -> Any:
        """Validate a crop to n columns: exact only if every row still holds the tokens its pattern would need after it
        (otherwise a CacheCropError names the row)."""
        key_pos = self.storage.key_pos
        rows = _per_row(seen, key_pos)
        kept = (key_pos >= 0) & (key_pos < rows)  # [B, (H,) S]
        have = (kept & self.spec.visible(rows, key_pos)).sum(-1)  # [B] or [B, H]: per head, the fewest counts
        have = have if have.dim() == 1 else have.min(1).values
        need = self.spec.needed_tokens(seen)
        if bool((have < need).any()):
            row = int((have < need).nonzero()[0])
            raise CacheCropError(
                f"{self.name}: cannot crop to {n} tokens exactly: row {row} would need its last {int(need[row])} "
                f"tokens but only {int(have[row])} are still held (the rest were evicted by the "
                f"{self.type_name} pattern). Take cache.snapshot() before the tokens you may roll back, "
                "and cache.restore() it instead."
            )
        return self.storage.prepare_crop(n, CropPlan(kept, seen))

    def _commit_crop(self, plan: Any) -> None:
        """Drop what a crop removes (the plan of `_prepare_crop`)."""
        self.storage.crop(plan, self._take)


@register_cache_layer("full")
class FullAttentionLayer(AttentionCacheLayer):
    """Full causal attention: keeps every token."""

    spec_cls = FullSpec
    evicts = False


@register_cache_layer("sliding")
class SlidingWindowLayer(AttentionCacheLayer):
    """Sliding-window attention over the last `window` tokens; keeps W-1 (dynamic) or a ring of W slots."""

    spec_cls = SlidingSpec
    example_params = {"window": 5}


@register_cache_layer("chunked")
class ChunkedAttentionLayer(AttentionCacheLayer):
    """Chunked attention (Llama4): keeps only the current chunk (dynamic) or a ring of C slots."""

    spec_cls = ChunkedSpec
    example_params = {"chunk_size": 4}
