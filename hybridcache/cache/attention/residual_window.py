"""The residual window (`residual: R` on any attention type with a quantized `storage`): KIVI / HF QuantizedCache.

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

from typing import Any

import torch

from hybridcache.cache.attention.staging import ResidualUndo

PARTS = ("res_keys", "res_values")  # [B, H, R', D] in the layer's dtype; positions in res_pos [B, R'] (-1: empty)


def allocate(layer: Any, batch: int) -> tuple[str, ...]:
    """Create the window's (empty) storage; returns the names of its batch tensors."""
    s = layer.spec
    if not s.residual:
        return ()
    size = s.residual_slots or 0  # dynamic storage grows from 0
    for name in PARTS:
        setattr(layer, name, torch.zeros(batch, s.num_kv_heads, size, s.head_dim, dtype=s.dtype, device=layer.device))
    layer.res_pos = torch.full((batch, size), -1, dtype=torch.long, device=layer.device)
    return (*PARTS, "res_pos")


def _slot_index(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    b, n = index.shape
    return index.view(b, 1, n, 1).expand(b, like.shape[1], n, like.shape[3])


def overlay(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded slots [B, H, S, D] with the window's dense copies put in where a slot holds a window position."""
    if not layer.spec.residual or layer.res_pos.shape[1] == 0:
        return keys, values
    key_pos, res_pos = layer.key_pos, layer.res_pos  # [B, S], [B, R']
    if layer.static:  # the ring slot of position p is p % size
        index = key_pos.clamp(min=0) % res_pos.shape[1]
        hit = (key_pos >= 0) & (res_pos.gather(1, index) == key_pos)
    else:
        match = (key_pos[:, :, None] == res_pos[:, None, :]) & (key_pos[:, :, None] >= 0)  # [B, S, R']
        hit, index = match.any(-1), match.to(torch.uint8).argmax(-1)
    hit = hit[:, None, :, None]
    return tuple(
        torch.where(hit, getattr(layer, n).gather(2, _slot_index(index, keys)), x)  # type: ignore[return-value]
        for n, x in zip(PARTS, (keys, values))
    )


def commit_dynamic(layer: Any, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, seen: torch.Tensor) -> None:
    """After a block and the pattern's eviction: keep each row's last R positions the pattern still holds."""
    r = layer.spec.residual
    keys, values = torch.cat([layer.res_keys, k], 2), torch.cat([layer.res_values, v], 2)
    pos = torch.cat([layer.res_pos, pos], 1)  # [B, R' + T]
    recent = (pos >= 0) & (pos >= seen[:, None] - r)
    columns = recent.any(0).nonzero().squeeze(1)
    keys, values, pos, recent = keys[:, :, columns], values[:, :, columns], pos[:, columns], recent[:, columns]
    held = (pos[:, :, None] == layer.key_pos[:, None, :]).any(-1)  # evicted by the pattern (TOVA): not kept
    pos = torch.where(recent & held, pos, -1)
    columns = (pos >= 0).any(0).nonzero().squeeze(1)
    layer.res_keys, layer.res_values, layer.res_pos = keys[:, :, columns], values[:, :, columns], pos[:, columns]


def commit_static(layer: Any, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, seen: torch.Tensor) -> None:
    """Write a block's last tokens per row into the ring (distinct slots: at most `size` consecutive positions)."""
    size = layer.res_pos.shape[1]
    if size == 0:
        return
    keep = (pos >= 0) & (pos >= seen[:, None] - size)  # [B, T]
    slots = torch.where(keep, pos.clamp(min=0) % size, size)
    source = torch.full((pos.shape[0], size + 1), -1, dtype=torch.long, device=pos.device)
    source.scatter_(1, slots, torch.arange(pos.shape[1], device=pos.device).expand_as(slots))
    source = source[:, :size]  # [B, size]: which block token lands in each ring slot, -1 for none
    hit, src = source >= 0, source.clamp(min=0)
    for name, x in zip(PARTS, (k, v)):
        dst = getattr(layer, name)
        dst.copy_(torch.where(hit[:, None, :, None], x.gather(2, _slot_index(src, x)), dst))
    layer.res_pos.copy_(torch.where(hit, pos.gather(1, src), layer.res_pos))


def write_decode(layer: Any, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> ResidualUndo | None:
    """A one-token decode step on preallocated storage: write its ring slot in place; returns what to put back."""
    size = layer.res_pos.shape[1] if layer.spec.residual else 0
    if size == 0:
        return None
    slots = pos % size  # [B, 1]
    old = {name: getattr(layer, name).gather(2, _slot_index(slots, k)) for name in PARTS}
    old_pos = layer.res_pos.gather(1, slots)
    for name, x in zip(PARTS, (k, v)):
        getattr(layer, name).scatter_(2, _slot_index(slots, x), x)
    layer.res_pos.scatter_(1, slots, pos)
    return ResidualUndo(slots, old, old_pos)


def undo_decode(layer: Any, undo: ResidualUndo | None) -> None:
    if undo is None:
        return
    slots, old, old_pos = undo.slots, undo.old, undo.old_pos
    for name, x in old.items():
        getattr(layer, name).scatter_(2, _slot_index(slots, x), x)
    layer.res_pos.scatter_(1, slots, old_pos)


def crop(layer: Any, seen: torch.Tensor) -> None:
    """Forget window entries at positions >= the new `seen` [B]."""
    if not layer.spec.residual:
        return
    dropped = layer.res_pos >= seen[:, None]
    if layer.static:
        layer.res_pos.masked_fill_(dropped, -1)
        return
    pos = layer.res_pos.masked_fill(dropped, -1)
    columns = (pos >= 0).any(0).nonzero().squeeze(1)
    layer.res_keys, layer.res_values = layer.res_keys[:, :, columns], layer.res_values[:, :, columns]
    layer.res_pos = pos[:, columns]
