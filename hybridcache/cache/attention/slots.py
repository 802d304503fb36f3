"""Slots a kernel writes itself (attention.py's decode_slot, reserve_slots, decode_block).

A decode kernel (blocks/attention/mixer.py's one-call attention, the many-layer call) writes a token's keys and values
straight into the slot the layer reserves, instead of handing them to `update`: `decode_slot` reserves the open
one-token block's slot. A decode run (blocks/fast/decode_run.py) reserves room for many tokens before any block is open
(`reserve_slots`), writes them step by step, and then feeds them as one block whose slots are taken as written
(`decode_block`). Only dense float32 storage appended in place (append_buffer.py), under a pattern the kernel
evaluates itself, qualifies (`writes_slots`); anything else is fed through `update`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Reserved(NamedTuple):
    """reserve_slots: the buffers behind a layer's keys, values [B, H, S', D] and key_pos [B, S'], its held slots
    [start, end) in them, and room for the reserved tokens from `end` on."""

    keys: torch.Tensor
    values: torch.Tensor
    key_pos: torch.Tensor
    start: int
    end: int


def writes_slots(layer: Any) -> bool:
    """Whether a kernel may write decode tokens' keys and values into the layer's slots itself: dense float32
    storage appended in place, a pattern the decode kernel evaluates, nothing staged, no attention weights read, a
    layer class that declares `kernel_writes_slots` (one that feeds its own way does not). An open block must be all
    real tokens too."""
    block = layer.seq.block
    return not (
        layer._append is None
        or layer._staged is not None
        or (block is not None and not block.all_real)
        or layer.spec.dtype != torch.float32
        or layer.spec.kernel_pattern() is None
        or layer.wants_attention_weights
        or not layer.kernel_writes_slots
    )


def decode_slot(layer: Any) -> tuple[Any, int] | None:
    """For a kernel that writes a decode token's keys and values itself (blocks/attention/mixer.py): the view the
    Cache's
    open block attends to and the slot (along dim 2 of its keys / values) left for the caller to write, the token's
    position already in the view's key positions. The caller must write that slot of every row before the view is
    read (or the block is aborted: the slot is never part of what the layer holds until the commit). None, changing
    nothing, where the layer needs `update`: a block that is not one real token per row, or see `writes_slots`."""
    block = layer.seq.block
    if block is None or block.tokens != 1 or not layer.writes_slots():
        return None
    view = layer._append_block(None, None, block)
    return view, view.keys.shape[2] - 1


def reserve_slots(layer: Any, tokens: int) -> Reserved | None:
    """For a decode that runs up to `tokens` steps before it feeds them as one block (blocks/fast/decode_run.py): room
    for them right after the held slots. None (nothing changed) where the layer needs `update` or a block is open.
    What the layer holds does not change (its tensors may become views of new buffers with the same values). The
    caller writes slots [end, end + n) of every row and then feeds a block of those n tokens, which `decode_block`
    hands out as written; anything else the layer does before (a block fed through `update`, a crop, a restore)
    ends the reservation (the written slots never become visible: a later append starts from what it holds)."""
    if layer.seq.block is not None or not layer.writes_slots() or tokens < 1:
        return None
    current = {name: getattr(layer, name) for name in layer._append.dims}
    views, start = layer._append.reserve(current, tokens)
    for name, t in views.items():
        setattr(layer, name, t)
    (keys, values), buffers = layer._parts, layer._append.buffers  # (dense storage: one part per side)
    return Reserved(buffers[keys], buffers[values], buffers["key_pos"], start, start + layer.key_pos.shape[1])


def decode_block(layer: Any) -> Any | None:
    """The open block's view with its tokens' slots taken as they are: the n slots after the held ones that the
    caller of `reserve_slots` wrote (the tokens' positions written into key_pos here). None, changing nothing,
    where the layer needs `update`."""
    block = layer.seq.block
    if block is None or not layer.writes_slots():
        return None
    return layer._append_block(None, None, block)
