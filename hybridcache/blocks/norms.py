"""RMSNorm, computed in (at least) float32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, or * (1 + weight) for Gemma-style norms (`unit_offset=True`). The weight multiplies
    the normalised x after the cast back to x's dtype (Llama), or before it with `scale_in_float32=True`
    (Nemotron-H; the same in float32 and float64)."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False, scale_in_float32: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset, self.scale_in_float32 = eps, unit_offset, scale_in_float32
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # at least float32
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Gemma: scale in float32, then cast
            return (normed * (1.0 + self.weight.to(normed.dtype))).to(x.dtype)
        if self.scale_in_float32:
            return (self.weight.to(normed.dtype) * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)  # Llama/Mamba: cast, then scale
