"""Attention cache layers: `full`, `sliding`, `chunked` (and the base that new patterns subclass).

Storage is per slot: the codec's parts of keys and values [B, H, S, ...] plus `key_pos`, the position each slot
holds (-1: empty or padding): [B, S] shared by a row's heads, or [B, H, S] per kv head for patterns that keep
different tokens per head (`spec.per_head`: kvpress's scorer presses). Masks come from the spec's pattern and
these positions alone.

Dynamic (max_length None): `update` returns cat(held, new); at commit only what some row's next query can still
see is kept (sliding: the last W-1 tokens, chunked: the current chunk), or what an eviction policy picks.
Preallocated (max_length set): static buffers whose slots the spec assigns (`slot_of`: linear for `full`, a ring of
W / C slots for `sliding` / `chunked`). A one-token decode block is written in place and the buffer itself is
returned: no roll, no copy of the window. Longer blocks attend over a copy and are written at commit.

Storage options on every pattern, chosen once at construction: the codec (`storage`, with `q_group_size` for
quantized formats), a residual window of dense recent tokens next to a quantized storage (`residual`: a
`ResidualWindow`, residual_window.py; layer-level storages such as `kivi` and `hf_quantized` own keys and values
instead: `GroupedSlots`, grouped_layer.py), spare slots that dynamic dense storage appends into (append_buffer.py),
and a storage tier that keeps
the parts off the compute device (`storage: offload`, offload_storage.py): the layer fetches them for its update
(and drops that copy once the view is built: it stages only the block's new keys/values), again for its commit and
for batch operations, and parks them after each, so about one layer's parts are on the compute device at a time.
What `update` stages for the open block is a typed record (staging.py); what a layer class can do is declared by
class flags (`own_eviction`, `kernel_writes_slots`, ...; docs/adding_cache_type.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from hybridcache.cache.attention.grouped_layer import GroupedSlots
from hybridcache.cache.attention.residual_window import NAMES as WINDOW_NAMES
from hybridcache.cache.attention.residual_window import ResidualWindow
from hybridcache.cache.attention.slots import Reserved
from hybridcache.cache.attention.specs import AttentionSpec, ChunkedSpec, FullSpec, SlidingSpec
from hybridcache.cache.attention.staging import (
    AttentionWrite,
    BlockWrite,
    CropPlan,
    DecodeWrite,
    GroupedWrite,
    ResidualUndo,
)
from hybridcache.cache.attention.view import AttentionView, _gather_slots, _per_row, _slot_index, check_kv
from hybridcache.cache.core.base import CacheLayer
from hybridcache.cache.core.errors import CacheConfigError, CacheCropError, CacheError
from hybridcache.cache.core.registry import register_cache_layer
from hybridcache.cache.core.sequence import BlockState
from hybridcache.cache.storage.append_buffer import AppendBuffers
from hybridcache.cache.storage.codecs import DenseCodec

SIDES = ("keys", "values")  # a layer's two stored tensors, in the order of (k, v)


def _window_tensor(name: str) -> property:
    """A layer attribute that is one of its residual window's tensors (AttributeError without a window)."""

    def get(layer: AttentionCacheLayer) -> torch.Tensor:
        if getattr(layer, "_window", None) is None:
            raise AttributeError(f"{layer.name} has no residual window")
        return layer._window.tensors[name]

    def put(layer: AttentionCacheLayer, t: torch.Tensor) -> None:
        get(layer)
        layer._window.tensors[name] = t

    return property(get, put)


class AttentionCacheLayer(CacheLayer):
    """Keys and values under a visibility pattern given by the spec, stored by the spec's codec.

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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_evict" in vars(cls) and "own_eviction" not in vars(cls):
            cls.own_eviction = True  # the pattern-only shortcuts of `_commit_block` must not skip it
        if ("update" in vars(cls) or "_write" in vars(cls)) and "kernel_writes_slots" not in vars(cls):
            cls.kernel_writes_slots = False  # it feeds its own way: a kernel must not write around it

    # -- storage -----------------------------------------------------------------------------------------------
    def _allocate(self, batch_size: int) -> None:
        s = self.spec
        self.codec = s.codec()
        slots = s.slots or 0
        self._parts: dict[str, tuple[str, str]] = {}  # attribute -> (side, codec part)
        for side in SIDES:
            for part, (shape, dtype) in self.codec.fields(s.head_dim, s.dtype).items():
                attr = f"{side}_{part or 'data'}"
                self._parts[attr] = (side, part)
                setattr(
                    self, attr, torch.zeros(batch_size, s.num_kv_heads, slots, *shape, dtype=dtype, device=self.device)
                )
        heads = (s.num_kv_heads,) if s.per_head else ()
        self.key_pos = torch.full((batch_size, *heads, slots), -1, dtype=torch.long, device=self.device)  # [B, (H,) S]
        self._grouped_rows: tuple[str, ...] = ()
        self._grouped = self._grouped_slots(batch_size)  # kivi / hf_quantized: it owns keys and values
        if self._grouped is not None:
            self._publish()
        self._window = (  # dense recent tokens next to a quantized storage
            ResidualWindow(s, batch_size, self.device, ring=self.static) if s.residual and not self._grouped else None
        )
        self._residual = WINDOW_NAMES if self._window is not None else ()
        self._tier = self.codec.tier(self)  # None: the parts stay on self.device
        # dynamic dense storage appends in place into spare slots (append_buffer.py)
        plain = (
            isinstance(self.codec, DenseCodec)
            and not self._residual
            and self._tier is None
            and not slots
            and not s.per_head
        )
        self._append = AppendBuffers({**{attr: 2 for attr in self._parts}, "key_pos": 1}) if plain else None
        self._park()

    # the residual window's tensors, saved, selected and restored by these names (the window owns them)
    res_keys = _window_tensor("res_keys")
    res_values = _window_tensor("res_values")
    res_pos = _window_tensor("res_pos")

    def _grouped_slots(self, batch_size: int) -> GroupedSlots | None:
        """The layer-level storage (None for a per-token codec); refuses what such a storage cannot follow."""
        codec, s = self.codec, self.spec
        if not getattr(codec, "grouped", False):
            return None
        if self.own_eviction or s.per_head or self.wants_attention_weights:
            raise CacheConfigError(
                f"{self.name}: storage '{codec.name}' quantizes the columns of the whole batch together, so it cannot "
                "follow an eviction that keeps different tokens per row or head (score-based methods); use it with "
                "full, sliding, chunked or sink attention, or a per-token storage (int8, int4) here"
            )
        return GroupedSlots(codec.storage(batch_size, s.num_kv_heads, s.head_dim, s.dtype, self.device), self.device)

    def _publish(self) -> None:
        """Mirror the layer-level storage's state as this layer's tensors (key_pos, kv_*)."""
        mirror = self._grouped.mirror()
        for name, t in mirror.tensors.items():
            setattr(self, name, t)
        self._grouped_rows, self._other_tensors = mirror.rows, mirror.other

    @property
    def _batch_tensors(self) -> tuple[str, ...]:  # type: ignore[override]
        return (*self._parts, *self._residual, "key_pos", *self._grouped_rows)

    def _release(self) -> None:
        """Drop the fetched copy of offloaded parts unwritten (after an update, or a block that failed)."""
        if self._tier is not None:
            self._tier.release()

    def nbytes(self) -> int:
        if self._grouped is not None:
            return self._grouped.nbytes()
        storages = {}
        for name in (*self._parts, *self._residual[:-1]):
            t = getattr(self, name)
            if t.numel():
                backed = self._append is not None and self._append.backs(name, t)  # a view of a buffer: its slots
                storages[t.untyped_storage().data_ptr()] = (
                    t.numel() * t.element_size() if backed else t.untyped_storage().nbytes()
                )
        return sum(storages.values())

    def spare_nbytes(self) -> int:
        """Bytes of spare slots after the held ones (dynamic dense storage appends into them in place)."""
        if self._append is None:
            return 0
        return self._append.spare_nbytes({name: getattr(self, name) for name in self._append.dims})

    @property
    def is_exact(self) -> bool:
        return self.exact and self.codec.exact

    @property
    def static(self) -> bool:
        return self.spec.max_length is not None

    def _side(self, side: str) -> dict[str, torch.Tensor]:
        return {part: getattr(self, attr) for attr, (s, part) in self._parts.items() if s == side}

    def _set_side(self, side: str, parts: dict[str, torch.Tensor]) -> None:
        for attr, (s, part) in self._parts.items():
            if s == side:
                setattr(self, attr, parts[part])

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values [B, H, S, D], decoded (the stored tensors themselves for dense storage), with
        the residual window's tokens unquantized."""
        if self._grouped is not None:
            return self._grouped.read()
        keys, values = (self.codec.decode(self._side(side), self.spec.dtype).to(self.device) for side in SIDES)
        if self._window is None:
            return keys, values
        return self._window.overlay(keys, values, self.key_pos)

    @property
    def keys(self) -> torch.Tensor:  # for dense storage, the stored tensor itself
        return self.read()[0]

    @property
    def values(self) -> torch.Tensor:
        return self.read()[1]

    def key_positions(self) -> torch.Tensor:
        """Positions [B, S] (per kv head: [B, H, S]) of the held keys (-1: padding or empty slot)."""
        return self.key_pos

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
            self._fetch()
            view = self._write(k, v, block)
            if self._tier is not None and not self.static:  # offload: room now for what the commit will park
                self._tier.check_room(dict(zip(self._parts, (view.keys, view.values))))
        except BaseException:
            self._close(opened, failed=True)
            self._release()
            raise
        self._release()  # offloaded: the parked parts are unchanged, the commit fetches them again
        self._close(opened, failed=False)
        return view

    def _write(self, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> AttentionView:
        if self._grouped is not None:
            self._staged = self._grouped.write(k, v, block)
            st = self._staged.staged
            return AttentionView(st.keys, st.values, block.positions, st.pos, self.spec)
        if self.static and block.all_real and block.tokens == 1:  # decode: write in place, attend over the buffer
            slots = self.spec.slot_of(block.positions)  # [B, 1]
            old = {attr: getattr(self, attr).gather(2, _slot_index(slots, getattr(self, attr))) for attr in self._parts}
            old_pos = self.key_pos.gather(1, slots)  # what the slot held, so an aborted block puts it back
            residual = self._write_slots(k, v, block.positions, slots)
            self._staged = DecodeWrite(slots, old, old_pos, residual, k, v, block)
            keys, values = self.read()
            return AttentionView(keys, values, block.positions, self.key_pos, self.spec)
        if self._append is not None:  # into spare slots: no copy of what is held
            return self._append_block(k, v, block)
        held_k, held_v = self.read()
        keys, values = torch.cat([held_k, k], dim=2), torch.cat([held_v, v], dim=2)  # [B, H, S + T, D]
        new_pos = block.positions  # [B, T]
        if self.key_pos.dim() == 3:  # per-head positions: every head holds the block's tokens
            new_pos = new_pos[:, None].expand(-1, self.key_pos.shape[1], -1)
        pos = torch.cat([self.key_pos, new_pos], dim=-1)  # [B, (H,) S + T]
        offloaded = self._tier is not None  # then do not keep the whole view alive until the commit
        self._staged = BlockWrite(k, v, None if offloaded else keys, None if offloaded else values, pos, block)
        return AttentionView(keys, values, block.positions, pos, self.spec)

    # -- slots a kernel writes itself ---------------------------------------------------------------------------
    # A decode kernel (blocks/attention/mixer.py's one-call attention, the many-layer call) writes a token's keys and
    # values straight into the slot the layer reserves, instead of handing them to `update`: `decode_slot` reserves
    # the open one-token block's slot. A decode run (accel/decode_run.py) reserves room for many tokens before any
    # block is open (`reserve_slots`), writes them step by step, and then feeds them as one block whose slots are
    # taken as written (`decode_block`). Only dense float32 storage appended in place (append_buffer.py), under a
    # pattern the kernel evaluates itself, qualifies (`writes_slots`); anything else is fed through `update`.
    def writes_slots(self) -> bool:
        """Whether a kernel may write decode tokens' keys and values into this layer's slots itself: dense float32
        storage appended in place, a pattern the decode kernel evaluates, nothing staged, no attention weights read,
        a layer class that declares `kernel_writes_slots` (one that feeds its own way does not). An open block must
        be all real tokens too."""
        block = self.seq.block
        return not (
            self._append is None
            or self._staged is not None
            or (block is not None and not block.all_real)
            or self.spec.dtype != torch.float32
            or self.spec.kernel_pattern() is None
            or self.wants_attention_weights
            or not self.kernel_writes_slots
        )

    def decode_slot(self) -> tuple[AttentionView, int] | None:
        """For a kernel that writes a decode token's keys and values itself (blocks/attention/mixer.py): the view the
        Cache's open block attends to and the slot (along dim 2 of its keys / values) left for the caller to write,
        the token's position already in the view's key positions. The caller must write that slot of every row
        before the view is read (or the block is aborted: the slot is never part of what the layer holds until the
        commit). None, changing nothing, where the layer needs `update`: a block that is not one real token per
        row, or see `writes_slots`."""
        block = self.seq.block
        if block is None or block.tokens != 1 or not self.writes_slots():
            return None
        view = self._append_block(None, None, block)
        return view, view.keys.shape[2] - 1

    def reserve_slots(self, tokens: int) -> Reserved | None:
        """For a decode that runs up to `tokens` steps before it feeds them as one block (accel/decode_run.py): room
        for them right after the held slots. None (nothing changed) where the layer needs `update` or a block is
        open. What the layer holds does not change (its tensors may become views of new buffers with the same
        values). The caller writes slots [end, end + n) of every row and then feeds a block of those n tokens,
        which `decode_block` hands out as written; anything else the layer does before (a block fed through
        `update`, a crop, a restore) ends the reservation (the written slots never become visible: a later append
        starts from what it holds)."""
        if self.seq.block is not None or not self.writes_slots() or tokens < 1:
            return None
        current = {name: getattr(self, name) for name in self._append.dims}
        views, start = self._append.reserve(current, tokens)
        for name, t in views.items():
            setattr(self, name, t)
        (keys, values), buffers = self._parts, self._append.buffers  # (dense storage: one part per side)
        return Reserved(buffers[keys], buffers[values], buffers["key_pos"], start, start + self.key_pos.shape[1])

    def decode_block(self) -> AttentionView | None:
        """The open block's view with its tokens' slots taken as they are: the n slots after the held ones that the
        caller of `reserve_slots` wrote (the tokens' positions written into key_pos here). None, changing nothing,
        where the layer needs `update`."""
        block = self.seq.block
        if block is None or not self.writes_slots():
            return None
        return self._append_block(None, None, block)

    def _append_block(self, k: torch.Tensor | None, v: torch.Tensor | None, block: BlockState) -> AttentionView:
        """Append the block into spare slots (k and v None: their slots left for the caller), staged as a block."""
        current = {name: getattr(self, name) for name in self._append.dims}
        views = self._append.append(current, dict(zip(self._parts, (k, v)), key_pos=block.positions), block.tokens)
        keys, values, pos = (views[name] for name in (*self._parts, "key_pos"))
        if k is None:  # the slots the caller writes
            k, v = keys.narrow(2, -block.tokens, block.tokens), values.narrow(2, -block.tokens, block.tokens)
        self._staged = BlockWrite(k, v, keys, values, pos, block)
        return AttentionView(keys, values, block.positions, pos, self.spec)

    def _write_slots(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> ResidualUndo | None:
        """Write a decode token [B, H, 1, D] into its slots [B, 1] of preallocated storage, in place."""
        for side, x in zip(SIDES, (k, v)):
            for part, t in self.codec.encode(x).items():
                self._side(side)[part].scatter_(2, _slot_index(slots, t), t)
        self.key_pos.scatter_(1, slots, positions)
        return None if self._window is None else self._window.write_decode(k, v, positions)

    def _commit_staged(self, staged: AttentionWrite) -> None:
        if isinstance(staged, GroupedWrite):
            self._grouped.commit(staged, self.spec.visible if self.evicts else None)
            return self._publish()
        if isinstance(staged, DecodeWrite):  # written in place; an offloaded layer dropped that copy and writes again
            if self._tier is not None:
                self._fetch()
                self._write_slots(staged.k, staged.v, staged.block.positions, staged.slots)
        else:
            self._fetch()
            self._commit_block(staged)
        self._park()

    def _commit_block(self, staged: BlockWrite) -> None:
        k, v, keys, values, pos, block = staged.k, staged.v, staged.keys, staged.values, staged.pos, staged.block
        if self.static:
            return self._commit_static(k, v, block)
        for side, new, full in zip(SIDES, (k, v), (keys, values)):
            if full is not None and isinstance(self.codec, DenseCodec):
                parts = self.codec.encode(full)  # dense: the view's tensors are the new storage, no second cat
            else:
                old, enc = self._side(side), self.codec.encode(new)
                parts = {p: torch.cat([old[p], enc[p]], dim=2) for p in old}
            self._set_side(side, parts)
        self.key_pos = pos
        # a pattern of a kernel form (full, sliding, chunked; declared equal to `visible`) keeps a suffix of the
        # slots: positions grow along the slots in every row, and what a query sees of them is a suffix
        form = self.spec.kernel_pattern() if self.evicts and not self.own_eviction else None
        if form is not None and form[0] == "sliding" and pos.shape[1] <= block.most_seen_after < form[1]:
            # the row that saw the most holds a real token in every one of the S held columns (its last S), all
            # still inside its window: nothing can be evicted yet (no per-step eviction ops before the window fills)
            pass
        elif form is not None and self._append is not None:
            # count the suffix some row's next query still sees, drop the rest as a view
            keep = int(((pos >= 0) & self.spec.keeps(block.seen_after[:, None], pos)).any(0).sum())
            if keep < pos.shape[1]:
                views = self._append.drop_oldest({a: getattr(self, a) for a in self._append.dims}, pos.shape[1] - keep)
                for attr, t in views.items():
                    setattr(self, attr, t)
        elif self.evicts:
            index = self._evict(pos, block.seen_after)
            if index is not None:
                self._take(index)
        if self._window is not None:
            self._window.commit_dynamic(k, v, block.positions, block.seen_after, self.key_pos)

    def _commit_static(self, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> None:
        """Write a block's tokens into their slots: per row, the ones `stays_in_slots` keeps (distinct slots)."""
        size = self.key_pos.shape[1]
        pos = block.positions  # [B, T]
        keep = self.spec.stays_in_slots(pos, block.seen_after[:, None]) & (pos >= 0)
        slots = torch.where(keep, self.spec.slot_of(pos.clamp(min=0)), size)  # [B, T]; size = nowhere
        source = torch.full((pos.shape[0], size + 1), -1, dtype=torch.long, device=self.device)
        source.scatter_(1, slots, torch.arange(pos.shape[1], device=self.device).expand_as(slots))
        source = source[:, :size]  # [B, S]: which block token lands in each slot, -1 for none
        hit = source >= 0
        for side, x in zip(SIDES, (k, v)):
            enc = self.codec.encode(x)
            for part, dst in self._side(side).items():
                new = _gather_slots(enc[part], source.clamp(min=0))  # [B, H, S, ...]
                mask = hit[:, None, :].reshape(*hit.shape[:1], 1, size, *([1] * (dst.dim() - 3)))
                dst.copy_(torch.where(mask, new, dst))
        self.key_pos.copy_(torch.where(hit, pos.gather(1, source.clamp(min=0)), self.key_pos))
        if self._window is not None:
            self._window.commit_static(k, v, pos, block.seen_after)

    def _abort_staged(self, staged: AttentionWrite) -> None:
        if isinstance(staged, DecodeWrite):  # put back what the written slot held
            self.key_pos.scatter_(1, staged.slots, staged.old_pos)
            if self._tier is None:  # offloaded: the parts were written in a fetched copy, the parked ones untouched
                for attr, t in staged.old.items():
                    getattr(self, attr).scatter_(2, _slot_index(staged.slots, t), t)
                if self._window is not None:
                    self._window.undo_decode(staged.residual)
        self._release()

    def _evict(self, pos: torch.Tensor, seen: torch.Tensor) -> torch.Tensor | None:
        """Slots to keep after a block ([S'] for all rows or [B, S'] per row); None keeps everything.

        Default: the slots some row's next query (at position `seen`) can still see.
        """
        keep = ((pos >= 0) & self.spec.keeps(_per_row(seen, pos), pos)).flatten(0, -2).any(0)  # [S]
        return None if bool(keep.all()) else keep.nonzero().squeeze(1)

    def _take(self, index: torch.Tensor) -> None:
        slots, n = self.key_pos.shape[1], index.numel()
        if (
            self._append is not None
            and index.dim() == 1
            and n < slots
            and torch.equal(index, torch.arange(slots - n, slots, device=index.device))
        ):
            # exactly the newest slots, in order: views, no copy
            views = self._append.drop_oldest({attr: getattr(self, attr) for attr in self._append.dims}, slots - n)
            for attr, t in views.items():
                setattr(self, attr, t)
            return
        for attr in self._parts:
            setattr(self, attr, _gather_slots(getattr(self, attr), index))
        if index.dim() == 1:
            self.key_pos = self.key_pos.index_select(-1, index)
        elif index.dim() == self.key_pos.dim():
            self.key_pos = self.key_pos.gather(-1, index)
        else:  # a per-row index over per-head positions
            self.key_pos = self.key_pos.gather(-1, index[:, None].expand(-1, self.key_pos.shape[1], -1))

    # -- batch operations on offloaded parts ---------------------------------------------------------------------
    def _prepare_index(self, index: Any, same_size: bool) -> torch.Tensor:
        index = super()._prepare_index(index, same_size)
        if self._grouped is not None:
            self._grouped.check_select(index)
        return index

    def _commit_index(self, index: torch.Tensor) -> None:
        if self._grouped is not None:
            self._grouped.select(index)
            return self._publish()
        self._fetch()
        super()._commit_index(index)
        self._park()

    def _commit_restore(self, snap: Any) -> None:
        if self._grouped is not None:
            self._grouped.restore(snap.tensors)
            return self._publish()
        super()._commit_restore(snap)
        self._park()

    # -- crop ------------------------------------------------------------------------------------------------
    def _prepare_crop(self, n: int, seen: torch.Tensor) -> CropPlan | dict[str, Any]:
        """Validate a crop to n columns: exact only if every row still holds the tokens its pattern would need after it
        (otherwise a CacheCropError names the row)."""
        rows = _per_row(seen, self.key_pos)
        kept = (self.key_pos >= 0) & (self.key_pos < rows)  # [B, (H,) S]
        have = (kept & self.spec.visible(rows, self.key_pos)).sum(-1)  # [B] or [B, H]: per head, the fewest counts
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
        if self._grouped is not None:
            return self._grouped.prepare_crop(n)
        return CropPlan(kept, seen)

    def _commit_crop(self, plan: CropPlan | dict[str, Any]) -> None:
        """Drop what a crop removes (the plan of `_prepare_crop`; the layer-level storage's next state for one)."""
        if self._grouped is not None:
            self._grouped.commit_crop(plan)
            return self._publish()
        kept, seen = plan.kept, plan.seen
        self._fetch()
        if self._window is not None:
            self._window.crop(seen)
        if self.static:
            self.key_pos.masked_fill_(~kept, -1)
        else:
            self.key_pos = torch.where(kept, self.key_pos, -1)
            columns = kept.flatten(0, -2).any(0)  # slots some row (and head) still holds
            if not bool(columns.all()):
                self._take(columns.nonzero().squeeze(1))
        self._park()


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
