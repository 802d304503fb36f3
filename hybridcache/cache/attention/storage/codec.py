"""Per-token codec storage (`storage: dense | int8 | int4 | fp8 ...`), dynamic: `CodecStorage`.

Each kept token's key and value are stored as the codec's parts [B, H, S, ...] (`keys_<part>` / `values_<part>`;
dense: `keys_data`, `values_data`) next to `key_pos` [B, (H,) S]. A block attends over cat(held, new) and is written
at commit, where the layer's eviction keeps what its pattern (or policy) needs. With `residual: R` a
`ResidualWindow` keeps each row's last R tokens unquantized next to the quantized slots (res_keys, res_values,
res_pos). Preallocated slots (static.py) and dense storage appended in place (append.py) build on this class.
"""

from __future__ import annotations

import torch

from hybridcache.cache.attention.residual_window import NAMES as WINDOW_NAMES
from hybridcache.cache.attention.residual_window import ResidualWindow
from hybridcache.cache.attention.specs import AttentionSpec
from hybridcache.cache.attention.staging import AttentionWrite, BlockWrite, CropPlan
from hybridcache.cache.attention.storage.protocol import AttentionStorage, Evict, Take
from hybridcache.cache.attention.view import AttentionView, _gather_slots
from hybridcache.cache.core.sequence import BlockState
from hybridcache.cache.storage.codecs import DenseCodec, KVCodec

SIDES = ("keys", "values")  # a layer's two stored tensors, in the order of (k, v)


class CodecStorage(AttentionStorage):
    """Kept tokens encoded one by one by a `KVCodec`, with an optional residual window of dense recent tokens."""

    def __init__(self, spec: AttentionSpec, codec: KVCodec, batch: int, device: torch.device) -> None:
        self.spec, self.codec, self.device = spec, codec, device
        self.exact = codec.exact
        slots = spec.slots or 0
        self.parts: dict[str, tuple[str, str]] = {}  # tensor name -> (side, codec part)
        self.tensors = {}
        for side in SIDES:
            for part, (shape, dtype) in codec.fields(spec.head_dim, spec.dtype).items():
                name = f"{side}_{part or 'data'}"
                self.parts[name] = (side, part)
                self.tensors[name] = torch.zeros(batch, spec.num_kv_heads, slots, *shape, dtype=dtype, device=device)
        heads = (spec.num_kv_heads,) if spec.per_head else ()
        self.tensors["key_pos"] = torch.full((batch, *heads, slots), -1, dtype=torch.long, device=device)
        preallocated = spec.max_length is not None
        self.window = ResidualWindow(spec, batch, device, preallocated, self.tensors) if spec.residual else None
        self.batch_names = (*self.parts, *(WINDOW_NAMES if self.window else ()), "key_pos")

    # -- reading -----------------------------------------------------------------------------------------------
    def side(self, side: str) -> dict[str, torch.Tensor]:
        """One side's codec parts: part -> [B, H, S, ...]."""
        return {part: self.tensors[name] for name, (s, part) in self.parts.items() if s == side}

    def set_side(self, side: str, parts: dict[str, torch.Tensor]) -> None:
        for name, (s, part) in self.parts.items():
            if s == side:
                self.tensors[name] = parts[part]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded keys and values [B, H, S, D] (dense: the stored tensors themselves), the residual window's tokens
        unquantized."""
        keys, values = (self.codec.decode(self.side(side), self.spec.dtype).to(self.device) for side in SIDES)
        if self.window is None:
            return keys, values
        return self.window.overlay(keys, values, self.key_pos)

    def nbytes(self) -> int:
        storages = {}
        for name in (*self.parts, *(WINDOW_NAMES[:-1] if self.window else ())):
            t = self.tensors[name]
            if t.numel():
                storages[t.untyped_storage().data_ptr()] = self._held_nbytes(name, t)
        return sum(storages.values())

    def _held_nbytes(self, name: str, t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes()

    # -- a block -----------------------------------------------------------------------------------------------
    def write(self, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> tuple[AttentionView, AttentionWrite]:
        """Attend over cat(held, new) [B, H, S + T, D]; the block is written at commit."""
        held_k, held_v = self.read()
        keys, values = torch.cat([held_k, k], dim=2), torch.cat([held_v, v], dim=2)  # [B, H, S + T, D]
        key_pos = self.key_pos
        new_pos = block.positions  # [B, T]
        if key_pos.dim() == 3:  # per-head positions: every head holds the block's tokens
            new_pos = new_pos[:, None].expand(-1, key_pos.shape[1], -1)
        pos = torch.cat([key_pos, new_pos], dim=-1)  # [B, (H,) S + T]
        return AttentionView(keys, values, block.positions, pos, self.spec), BlockWrite(k, v, keys, values, pos, block)

    def commit(self, staged: AttentionWrite, evict: Evict | None) -> None:
        assert isinstance(staged, BlockWrite)
        dense = isinstance(self.codec, DenseCodec)
        for side, new, full in zip(SIDES, (staged.k, staged.v), (staged.keys, staged.values)):
            if full is not None and dense:
                parts = self.codec.encode(full)  # dense: the view's tensors are the new storage, no second cat
            else:
                old, enc = self.side(side), self.codec.encode(new)
                parts = {p: torch.cat([old[p], enc[p]], dim=2) for p in old}
            self.set_side(side, parts)
        self.tensors["key_pos"] = staged.pos
        if evict is not None:
            evict(staged.pos, staged.block)
        if self.window is not None:
            block = staged.block
            self.window.commit_dynamic(staged.k, staged.v, block.positions, block.seen_after, self.key_pos)

    # -- slots and crops ---------------------------------------------------------------------------------------
    def take(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        for name in self.parts:
            self.tensors[name] = _gather_slots(self.tensors[name], index)
        key_pos = self.key_pos
        if index.dim() == 1:
            key_pos = key_pos.index_select(-1, index)
        elif index.dim() == key_pos.dim():
            key_pos = key_pos.gather(-1, index)
        else:  # a per-row index over per-head positions
            key_pos = key_pos.gather(-1, index[:, None].expand(-1, key_pos.shape[1], -1))
        self.tensors["key_pos"] = key_pos if valid is None else torch.where(valid, key_pos, -1)

    def crop(self, plan: CropPlan, take: Take) -> None:
        if self.window is not None:
            self.window.crop(plan.seen)
        self.tensors["key_pos"] = torch.where(plan.kept, self.key_pos, -1)
        columns = plan.kept.flatten(0, -2).any(0)  # slots some row (and head) still holds
        if not bool(columns.all()):
            take(columns.nonzero().squeeze(1))
