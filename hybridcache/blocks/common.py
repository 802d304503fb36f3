"""What every block gets besides its hidden states and its cache layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepInput:
    """The block being processed: token positions from the cache and which tokens are real."""

    positions: torch.Tensor  # [B, T] long, -1 for padding
    valid: torch.Tensor  # [B, T] bool
    all_real: bool = False  # no padding in this block: lets cache layers skip their mask checks

    @property
    def cache_valid(self) -> torch.Tensor | int:
        """What a cache layer's `update` takes: the mask, or just the block length when every token is real."""
        return self.valid.shape[1] if self.all_real else self.valid

    @property
    def rope_positions(self) -> torch.Tensor:
        """Positions for rotary embeddings ([B, T]; padding gets 0, it is never attended to)."""
        return self.positions.clamp(min=0)

    def mask_padding(self, x: torch.Tensor) -> torch.Tensor:
        """Zero the padding tokens of x [B, T, ...] so they leave recurrent states untouched."""
        if self.all_real:
            return x
        return x * self.valid.view(*self.valid.shape, *([1] * (x.dim() - 2))).to(x.dtype)
