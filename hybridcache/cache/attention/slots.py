"""What `AttentionCacheLayer.reserve_slots` hands a decode run (accel/runs/decode_run.py): the buffers a kernel writes
decode tokens' keys and values into itself (layer.py's "slots a kernel writes itself" has the protocol)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Reserved(NamedTuple):
    """reserve_slots: the buffers behind a layer's keys, values [B, H, S', D] and key_pos [B, S'], its held slots
    [start, end) in them, and room for the reserved tokens from `end` on."""

    keys: torch.Tensor
    values: torch.Tensor
    key_pos: torch.Tensor
    start: int
    end: int
