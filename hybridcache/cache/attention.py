"""Attention cache layers: `full`, `sliding`, `chunked`.

Storage is per column: keys/values [B, H, S, D] plus `slot_col` [S], the block column each slot holds (-1: empty).
A row's position for column c is `c - pad` with `pad = columns - seen` (left padding only), so masks come from the
pattern and the held columns alone; no caller passes positions.

Dynamic (max_length None): `update` returns cat(held, new); afterwards only the columns some row can still see
are kept (sliding: the last W-1 tokens, chunked: the current chunk). Preallocated (max_length set): static
buffers; `full` writes into a linear buffer of max_length slots, `sliding`/`chunked` into a ring of W / C slots.
A single-token block is written in place and the ring itself is returned: no roll, no copy of the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.cache.attention_specs import AttentionSpec, ChunkedSpec, FullSpec, SlidingSpec
from hybridcache.cache.base import CacheLayer, check_valid_mask
from hybridcache.cache.errors import CacheCropError, CacheError
from hybridcache.cache.registry import register_cache_layer


def column_positions(cols: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Positions [B, S] of columns `cols` [S] for rows with `pad` [B] padding columns; -1 for padding/empty."""
    pos = cols[None, :] - pad[:, None]
    return torch.where((cols[None, :] >= 0) & (pos >= 0), pos, -1)


@dataclass
class AttentionView:
    """What one block attends to: keys/values [B, H, S, D], their positions [B, S], the queries' [B, T]."""

    keys: torch.Tensor
    values: torch.Tensor
    query_positions: torch.Tensor  # [B, T], -1 for padding
    key_positions: torch.Tensor  # [B, S], -1 for padding or empty slots
    spec: AttentionSpec

    @property
    def mask(self) -> torch.Tensor:
        """Boolean visibility [B, T, S]: True where query t may attend to key s."""
        q = self.query_positions[:, :, None]
        k = self.key_positions[:, None, :]
        return (q >= 0) & (k >= 0) & self.spec.visible(q, k)


class AttentionCacheLayer(CacheLayer):
    """Keys and values under a visibility pattern given by the spec; dynamic or preallocated storage."""

    kind = "attention"
    spec_cls = AttentionSpec
    evicts = True  # False for patterns where every earlier token stays visible
    spec: AttentionSpec
    _batch_tensors = ("keys", "values")
    _other_tensors = ("slot_col",)

    def _allocate(self, batch_size: int) -> None:
        s = self.spec
        slots = s.slots or 0
        shape = (batch_size, s.num_kv_heads, slots, s.head_dim)  # [B, H, S, D]
        self.keys = torch.zeros(shape, dtype=s.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=s.dtype, device=self.device)
        self.slot_col = torch.full((slots,), -1, dtype=torch.long, device=self.device)

    @property
    def static(self) -> bool:
        return self.spec.max_length is not None

    def key_positions(self) -> torch.Tensor:
        """Positions [B, S] of the held keys (-1: padding or empty slot)."""
        return column_positions(self.slot_col, self.columns - self.seen)

    # -- update ------------------------------------------------------------------------------------------------
    def _check_block(self, k: Any, v: Any, valid: Any) -> torch.Tensor:
        s, name = self.spec, self.name
        for label, t in (("keys", k), ("values", v)):
            if not isinstance(t, torch.Tensor):
                raise CacheError(f"{name}: {label} must be a tensor [B, H, T, D], got {type(t).__name__}")
            if t.dim() != 4:
                raise CacheError(f"{name}: {label} must have 4 dims [B, H, T, D], got shape {tuple(t.shape)}")
            b, h, n, d = t.shape
            if b != self.batch_size:
                raise CacheError(f"{name}: {label} have batch size {b}, the cache was built for {self.batch_size}")
            if h != s.num_kv_heads:
                raise CacheError(f"{name}: {label} have {h} heads, the layer holds {s.num_kv_heads} kv heads")
            if d != s.head_dim:
                raise CacheError(f"{name}: {label} have head_dim {d}, the layer holds head_dim {s.head_dim}")
            if t.dtype != s.dtype:
                raise CacheError(f"{name}: {label} have dtype {t.dtype}, the layer holds {s.dtype}")
            if t.device != self.device:
                raise CacheError(f"{name}: {label} are on {t.device}, the layer is on {self.device}")
        if k.shape != v.shape:
            raise CacheError(f"{name}: keys {tuple(k.shape)} and values {tuple(v.shape)} differ in shape")
        tokens = k.shape[2]
        if tokens == 0:
            raise CacheError(f"{name}: empty block (0 tokens)")
        if self.static and self.columns + tokens > s.max_length:
            raise CacheError(
                f"{name}: a block of {tokens} tokens after {self.columns} exceeds the preallocated "
                f"max_length={s.max_length}; build the cache with a larger max_length"
            )
        if isinstance(valid, int) and not isinstance(valid, bool):
            if valid != tokens:
                raise CacheError(f"{name}: valid={valid} tokens, but the block has {tokens}")
            valid = None
        return check_valid_mask(valid, self.batch_size, tokens, self.seen, name)

    def update(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | int | None = None) -> AttentionView:
        """Append a block k, v [B, H, T, D] (`valid` [B, T]: real tokens; None or T = all real).

        Returns everything the block must attend to, with positions for the mask.
        """
        valid = self._check_block(k, v, valid)
        tokens = k.shape[2]
        cols = torch.arange(self.columns, self.columns + tokens, device=self.device)  # [T]
        seen = self.seen + valid.sum(1)
        pad = (self.columns + tokens) - seen  # [B] padding columns per row
        if self.static:
            keys, values, key_cols = self._write_static(k, v, cols)
        else:
            keys, values, key_cols = self._write_dynamic(k, v, cols, seen, pad)
        self.columns += tokens
        self.seen = seen
        query_pos = torch.where(valid, cols[None, :] - pad[:, None], -1)
        return AttentionView(keys, values, query_pos, column_positions(key_cols, pad), self.spec)

    def _keep(self, cols: torch.Tensor, seen: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Which columns [S] some row's next query can still see."""
        pos = column_positions(cols, pad)
        return ((pos >= 0) & self.spec.visible(seen[:, None], pos)).any(0)

    def _write_dynamic(self, k, v, cols, seen, pad):
        keys = torch.cat([self.keys, k], dim=2)  # [B, H, S + T, D]
        values = torch.cat([self.values, v], dim=2)
        key_cols = torch.cat([self.slot_col, cols])
        self.keys, self.values, self.slot_col = keys, values, key_cols
        if self.evicts:  # drop what no row can see any more
            keep = self._keep(key_cols, seen, pad)
            if not bool(keep.all()):
                idx = keep.nonzero().squeeze(1)
                self.keys, self.values = keys.index_select(2, idx), values.index_select(2, idx)
                self.slot_col = key_cols[idx]
        return keys, values, key_cols

    def _write_static(self, k, v, cols):
        tokens, ring = k.shape[2], self.spec.ring_size
        if ring is None:  # linear buffer: columns are slots
            self.keys.index_copy_(2, cols, k)
            self.values.index_copy_(2, cols, v)
            self.slot_col.index_copy_(0, cols, cols)
            return self.keys, self.values, self.slot_col
        size = self.slot_col.shape[0]
        if tokens == 1:  # decode: overwrite the oldest slot, attend over the ring in place
            slots = cols % size
            self.keys.index_copy_(2, slots, k)
            self.values.index_copy_(2, slots, v)
            self.slot_col.index_copy_(0, slots, cols)
            return self.keys, self.values, self.slot_col
        # A longer block's first queries still need slots its later tokens overwrite: attend over a copy.
        keys = torch.cat([self.keys, k], dim=2)
        values = torch.cat([self.values, v], dim=2)
        key_cols = torch.cat([self.slot_col, cols])
        n = min(tokens, size)
        slots = cols[-n:] % size
        self.keys.index_copy_(2, slots, k[:, :, -n:])
        self.values.index_copy_(2, slots, v[:, :, -n:])
        self.slot_col.index_copy_(0, slots, cols[-n:])
        return keys, values, key_cols

    # -- crop --------------------------------------------------------------------------------------------------
    def _prepare_crop(self, n: Any):
        n = self._check_crop_length(n)
        seen = (self.seen - (self.columns - n)).clamp(min=0)
        pad = n - seen
        kept = (self.slot_col >= 0) & (self.slot_col < n)  # [S]
        pos = column_positions(torch.where(kept, self.slot_col, -1), pad)
        have = ((pos >= 0) & self.spec.visible(seen[:, None], pos)).sum(1)
        need = self.spec.needed_tokens(seen)
        if bool((have < need).any()):
            row = int((have < need).nonzero()[0])
            raise CacheCropError(
                f"{self.name}: cannot crop to {n} tokens exactly: row {row} would need its last {int(need[row])} "
                f"tokens but only {int(have[row])} are still held (the rest were evicted by the "
                f"{self.type_name} pattern). Take cache.snapshot() before the tokens you may roll back, "
                "and cache.restore() it instead."
            )
        return n, seen, kept

    def _commit_crop(self, plan) -> None:
        n, seen, kept = plan
        if self.static:
            self.slot_col.masked_fill_(~kept, -1)
        else:
            idx = kept.nonzero().squeeze(1)
            self.keys, self.values = self.keys.index_select(2, idx), self.values.index_select(2, idx)
            self.slot_col = self.slot_col[idx]
        self.columns, self.seen = n, seen


@register_cache_layer("full")
class FullAttentionLayer(AttentionCacheLayer):
    """Full causal attention: keeps every token."""

    spec_cls = FullSpec
    evicts = False


@register_cache_layer("sliding")
class SlidingWindowLayer(AttentionCacheLayer):
    """Sliding-window attention over the last `window` tokens; keeps W-1 (dynamic) or a ring of W slots."""

    spec_cls = SlidingSpec


@register_cache_layer("chunked")
class ChunkedAttentionLayer(AttentionCacheLayer):
    """Chunked attention (Llama4): keeps only the current chunk (dynamic) or a ring of C slots."""

    spec_cls = ChunkedSpec
