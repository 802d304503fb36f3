"""Preallocated attention storage: writing a block's tokens into the slots the spec assigns (cache/attention/layer.py's
static layout; a one-token decode block is written in place by the layer itself)."""

from __future__ import annotations

import torch

from hybridcache.cache.attention.view import _gather_slots
from hybridcache.cache.core.sequence import BlockState

SIDES = ("keys", "values")  # a layer's two stored tensors, in the order of (k, v)


def commit_block(layer, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> None:
    """Write a block's tokens into their slots: per row, the ones `stays_in_slots` keeps (distinct slots)."""
    size = layer.key_pos.shape[1]
    pos = block.positions  # [B, T]
    keep = layer.spec.stays_in_slots(pos, block.seen_after[:, None]) & (pos >= 0)
    slots = torch.where(keep, layer.spec.slot_of(pos.clamp(min=0)), size)  # [B, T]; size = nowhere
    source = torch.full((pos.shape[0], size + 1), -1, dtype=torch.long, device=layer.device)
    source.scatter_(1, slots, torch.arange(pos.shape[1], device=layer.device).expand_as(slots))
    source = source[:, :size]  # [B, S]: which block token lands in each slot, -1 for none
    hit = source >= 0
    for side, x in zip(SIDES, (k, v)):
        enc = layer.codec.encode(x)
        for part, dst in layer._side(side).items():
            new = _gather_slots(enc[part], source.clamp(min=0))  # [B, H, S, ...]
            mask = hit[:, None, :].reshape(*hit.shape[:1], 1, size, *([1] * (dst.dim() - 3)))
            dst.copy_(torch.where(mask, new, dst))
    layer.key_pos.copy_(torch.where(hit, pos.gather(1, source.clamp(min=0)), layer.key_pos))
    if layer._window is not None:
        layer._window.commit_static(k, v, pos, block.seen_after)
