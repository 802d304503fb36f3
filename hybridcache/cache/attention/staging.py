"""What an attention cache layer stages for the open block between `update` and its commit or abort.

One record type per way a block is written: a one-token decode step written in place into preallocated slots
(`DecodeWrite`, which keeps what the slots held so an abort can put it back), any other block attended over a
concatenated (or appended) view and written at commit (`BlockWrite`), and a block prepared by a layer-level storage
(`GroupedWrite`: kivi, hf_quantized). The commit dispatches on the record's type, never on a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.core.sequence import BlockState
from hybridcache.cache.storage.grouped import Staged


@dataclass
class ResidualUndo:
    """What a decode step overwrote in the residual window's ring (ResidualWindow.write_decode)."""

    slots: torch.Tensor  # [B, 1] ring slots written
    old: dict[str, torch.Tensor]  # res_keys / res_values -> what those slots held [B, H, 1, D]
    old_pos: torch.Tensor  # [B, 1]


@dataclass
class DecodeWrite:
    """A one-token block already written into its preallocated slots (the view is the buffer itself)."""

    slots: torch.Tensor  # [B, 1] the slots written
    old: dict[str, torch.Tensor]  # storage attribute -> what those slots held [B, H, 1, ...]
    old_pos: torch.Tensor  # [B, 1] the positions they held
    residual: ResidualUndo | None  # what the residual window's ring held there (None: no window)
    k: torch.Tensor  # [B, H, 1, D] the token's keys and values (an offloaded layer writes them again at commit)
    v: torch.Tensor
    block: BlockState

    @property
    def tokens(self) -> int:
        return 1


@dataclass
class BlockWrite:
    """A block attended over held + new slots, written into storage at commit."""

    k: torch.Tensor  # [B, H, T, D] the block's keys and values
    v: torch.Tensor
    keys: torch.Tensor | None  # [B, H, S + T, D] the view (None: not kept alive until the commit: offloaded storage)
    values: torch.Tensor | None
    pos: torch.Tensor  # [B, (H,) S + T] the view's key positions
    block: BlockState

    @property
    def tokens(self) -> int:
        return self.k.shape[2]


@dataclass
class GroupedWrite:
    """A block prepared by a layer-level storage (grouped_codecs.py); the storage's next state is in `staged`."""

    staged: Staged
    block: BlockState

    @property
    def tokens(self) -> int:
        return self.block.tokens


AttentionWrite = DecodeWrite | BlockWrite | GroupedWrite


@dataclass
class CropPlan:
    """What a validated crop keeps: the held slots below each row's new length, and that length."""

    kept: torch.Tensor  # [B, (H,) S]
    seen: torch.Tensor  # [B]
