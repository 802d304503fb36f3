"""Specs of the attention cache types and their visibility patterns.

W counts the visible tokens including the current one (HF masking_utils, flash-attn (W-1, 0), MLX):
    full        kv <= q
    sliding(W)  q - W < kv <= q
    chunked(C)  kv // C == q // C  and  kv <= q
Positions are absolute token positions of a row, left padding excluded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.base import LayerSpec, check_positive_int, dtype_nbytes, tunable


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(LayerSpec):
    """Keys and values of `num_kv_heads` heads of size `head_dim`; `max_length` preallocates static storage."""

    num_kv_heads: int
    head_dim: int
    max_length: int | None = tunable(None)

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_positive_int(owner, "num_kv_heads", self.num_kv_heads)
        check_positive_int(owner, "head_dim", self.head_dim)
        check_positive_int(owner, "max_length", self.max_length, allow_none=True)

    # -- the pattern -------------------------------------------------------------------------------------------
    def visible(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """May a query at position q see a key at position kv? (broadcasting; both >= 0)"""
        return kv <= q

    def needed_tokens(self, seen: torch.Tensor | int) -> torch.Tensor | int:
        """How many earlier tokens the next query (at position `seen`) can see: what must stay held."""
        return seen

    @property
    def ring_size(self) -> int | None:
        """Slots of a preallocated ring buffer (None: a linear buffer of max_length slots)."""
        return None

    # -- memory ------------------------------------------------------------------------------------------------
    @property
    def token_nbytes(self) -> int:
        """Bytes of one token's key and value."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_nbytes(self.dtype)

    @property
    def slots(self) -> int | None:
        """Preallocated slots per row (None when storage is dynamic)."""
        if self.max_length is None:
            return None
        return self.max_length if self.ring_size is None else min(self.ring_size, self.max_length)

    def min_nbytes(self, batch: int, tokens: int) -> int:
        return batch * int(self.needed_tokens(tokens)) * self.token_nbytes

    def held_nbytes(self, batch: int, tokens: int) -> int:
        if self.slots is not None:
            return batch * self.slots * self.token_nbytes
        return self.min_nbytes(batch, tokens)


@dataclass(frozen=True, kw_only=True)
class FullSpec(AttentionSpec):
    """Every earlier token stays visible."""


@dataclass(frozen=True, kw_only=True)
class SlidingSpec(AttentionSpec):
    """The last `window` tokens are visible, the current one included."""

    window: int = tunable()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(type(self).__name__, "window", self.window)

    def visible(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (kv > q - self.window)

    def needed_tokens(self, seen):
        return seen.clamp(max=self.window - 1) if isinstance(seen, torch.Tensor) else min(seen, self.window - 1)

    @property
    def ring_size(self) -> int:
        return self.window  # W-1 held tokens plus the slot the decode token is written into


@dataclass(frozen=True, kw_only=True)
class ChunkedSpec(AttentionSpec):
    """Tokens see the earlier tokens of their own chunk of `chunk_size` positions."""

    chunk_size: int = tunable()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(type(self).__name__, "chunk_size", self.chunk_size)

    def visible(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (torch.div(kv, self.chunk_size, rounding_mode="floor") == q // self.chunk_size)

    def needed_tokens(self, seen):
        return seen % self.chunk_size

    @property
    def ring_size(self) -> int:
        return self.chunk_size
