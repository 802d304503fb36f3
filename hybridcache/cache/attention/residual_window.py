"""The residual window (`residual: R` on any attention type with a quantized `storage`): KIVI / HF QuantizedCache.
`ResidualWindow` keeps its tensors in its storage's `tensors` (the layer shows them as `res_keys`, `res_values`,
`res_pos`).

Per row, the most recent R tokens are read unquantized: a token at position p is dense while p >= seen - R, and
from its quantized copy afterwards. Every token is written to the pattern's slot storage in `storage` as usual (the
pattern alone decides what is kept, eviction and layouts are unchanged); next to it the layer keeps a dense copy
of each row's last R tokens that the pattern still holds, with their positions, and `read()` overlays them on the
decoded slots. So
- tokens inside the window are returned bit-exactly, and a layer whose rows have seen at most R tokens is exact;
- quantization is per token, so a token's stored integers never depend on how the sequence was split;
- bytes held: needed tokens x quantized bytes + min(needed, R) x dense bytes (the window's tokens are held in both
  forms; HF keeps them dense only, min(needed, R) quantized tokens fewer: under 1/6 of the window for int4).
Dynamic storage keeps the window compact (cat, then the columns some row still keeps); preallocated storage keeps a
ring of min(R, slots) slots per row, slot = position % size, written in place by a decode step (so there the window
is the last min(R, slots) positions: a `sink` layer's sink tokens stay quantized once they leave it).
After `crop(n)` the tokens that re-enter the window (those between the new and the old window start) are read from
their quantized copies; every later token is dense again while inside the window.
"""

from __future__ import annotations

import torch

from hybridcache.cache.attention.staging import ResidualUndo

PARTS = ("res_keys", "res_values")  # [B, H, R', D] in the layer's dtype; positions in res_pos [B, R'] (-1: empty)
NAMES = (*PARTS, "res_pos")  # what the layer saves, selects and restores by name


def _slot_index(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    b, n = index.shape
    return index.view(b, 1, n, 1).expand(b, like.shape[1], n, like.shape[3])


class ResidualWindow:
    """Each row's last R tokens the pattern holds, unquantized: dense copies [B, H, R', D] and their positions
    [B, R'] (-1: empty). Dynamic: compact columns (R' grows from 0); preallocated (`ring`): min(R, slots) slots,
    slot = position % size, written in place by a decode step."""

    def __init__(self, spec, batch: int, device: torch.device, ring: bool, tensors: dict | None = None) -> None:
        self.residual, self.ring = spec.residual, ring
        size = spec.residual_slots or 0  # dynamic storage grows from 0
        shape = (batch, spec.num_kv_heads, size, spec.head_dim)
        self.tensors = {} if tensors is None else tensors  # (its storage's: the window's names are added to it)
        self.tensors.update({name: torch.zeros(shape, dtype=spec.dtype, device=device) for name in PARTS})
        self.tensors["res_pos"] = torch.full((batch, size), -1, dtype=torch.long, device=device)

    @property
    def pos(self) -> torch.Tensor:
        return self.tensors["res_pos"]

    def overlay(
        self, keys: torch.Tensor, values: torch.Tensor, key_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded slots [B, H, S, D] (positions `key_pos` [B, S]) with the window's dense copies put in where a
        slot holds a window position."""
        res_pos = self.pos  # [B, R']
        if res_pos.shape[1] == 0:
            return keys, values
        if self.ring:  # the ring slot of position p is p % size
            index = key_pos.clamp(min=0) % res_pos.shape[1]
            hit = (key_pos >= 0) & (res_pos.gather(1, index) == key_pos)
        else:
            match = (key_pos[:, :, None] == res_pos[:, None, :]) & (key_pos[:, :, None] >= 0)  # [B, S, R']
            hit, index = match.any(-1), match.to(torch.uint8).argmax(-1)
        hit = hit[:, None, :, None]
        return tuple(
            torch.where(hit, self.tensors[n].gather(2, _slot_index(index, keys)), x)  # type: ignore[return-value]
            for n, x in zip(PARTS, (keys, values))
        )

    def commit_dynamic(
        self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, seen: torch.Tensor, key_pos: torch.Tensor
    ) -> None:
        """After a block and the pattern's eviction (the layer now holds `key_pos`): keep each row's last R
        positions the pattern still holds."""
        r, t = self.residual, self.tensors
        keys, values = torch.cat([t["res_keys"], k], 2), torch.cat([t["res_values"], v], 2)
        pos = torch.cat([t["res_pos"], pos], 1)  # [B, R' + T]
        recent = (pos >= 0) & (pos >= seen[:, None] - r)
        columns = recent.any(0).nonzero().squeeze(1)
        keys, values, pos, recent = keys[:, :, columns], values[:, :, columns], pos[:, columns], recent[:, columns]
        held = (pos[:, :, None] == key_pos[:, None, :]).any(-1)  # evicted by the pattern (TOVA): not kept
        pos = torch.where(recent & held, pos, -1)
        columns = (pos >= 0).any(0).nonzero().squeeze(1)
        t["res_keys"], t["res_values"], t["res_pos"] = keys[:, :, columns], values[:, :, columns], pos[:, columns]

    def commit_static(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, seen: torch.Tensor) -> None:
        """Write a block's last tokens per row into the ring (distinct slots: at most `size` consecutive positions)."""
        size = self.pos.shape[1]
        if size == 0:
            return
        keep = (pos >= 0) & (pos >= seen[:, None] - size)  # [B, T]
        slots = torch.where(keep, pos.clamp(min=0) % size, size)
        source = torch.full((pos.shape[0], size + 1), -1, dtype=torch.long, device=pos.device)
        source.scatter_(1, slots, torch.arange(pos.shape[1], device=pos.device).expand_as(slots))
        source = source[:, :size]  # [B, size]: which block token lands in each ring slot, -1 for none
        hit, src = source >= 0, source.clamp(min=0)
        for name, x in zip(PARTS, (k, v)):
            dst = self.tensors[name]
            dst.copy_(torch.where(hit[:, None, :, None], x.gather(2, _slot_index(src, x)), dst))
        self.pos.copy_(torch.where(hit, pos.gather(1, src), self.pos))

    def write_decode(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> ResidualUndo | None:
        """A one-token decode step on preallocated storage: write its ring slot in place; returns what to put back."""
        size = self.pos.shape[1]
        if size == 0:
            return None
        slots = pos % size  # [B, 1]
        old = {name: self.tensors[name].gather(2, _slot_index(slots, k)) for name in PARTS}
        old_pos = self.pos.gather(1, slots)
        for name, x in zip(PARTS, (k, v)):
            self.tensors[name].scatter_(2, _slot_index(slots, x), x)
        self.pos.scatter_(1, slots, pos)
        return ResidualUndo(slots, old, old_pos)

    def undo_decode(self, undo: ResidualUndo | None) -> None:
        if undo is None:
            return
        for name, x in undo.old.items():
            self.tensors[name].scatter_(2, _slot_index(undo.slots, x), x)
        self.pos.scatter_(1, undo.slots, undo.old_pos)

    def crop(self, seen: torch.Tensor) -> None:
        """Forget window entries at positions >= the new `seen` [B]."""
        dropped = self.pos >= seen[:, None]
        if self.ring:
            self.pos.masked_fill_(dropped, -1)
            return
        t = self.tensors
        pos = t["res_pos"].masked_fill(dropped, -1)
        columns = (pos >= 0).any(0).nonzero().squeeze(1)
        t["res_keys"], t["res_values"] = t["res_keys"][:, :, columns], t["res_values"][:, :, columns]
        t["res_pos"] = pos[:, columns]
