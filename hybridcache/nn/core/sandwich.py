"""A decoder layer of the sandwich-norm shape (Gemma 3): attention, then the gated MLP, each branch between a
pre-norm and a post-norm and added to the residual stream.

    h1 = h + post_attn(attn(input_norm(h)))        out = h1 + post_mlp(mlp(pre_mlp(h1)))

A family's layer names its modules by role (`parts()`); `forward` is the reference. The CPU fast path computes a
layer of this shape in one kernel call (hybridcache.accel installs it as `accel`; None: none).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.norms import residual_norm


class SandwichParts(NamedTuple):
    """The modules of a sandwich-norm layer by role (a norm None: none)."""

    input_norm: nn.Module | None
    attn: nn.Module  # an AttentionMixer: forward(h, layer, step, norm=input_norm)
    post_attn: nn.Module | None
    pre_mlp: nn.Module | None
    mlp: nn.Module
    post_mlp: nn.Module | None


class SandwichLayer(nn.Module):
    """Base of a sandwich-norm decoder layer: a subclass builds the modules and says which is which (`parts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.accel = None  # hybridcache.accel's fast path for this layer, once installed

    def parts(self) -> SandwichParts:
        raise NotImplementedError

    def forward(self, h: torch.Tensor, layer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        if self.accel is not None:
            out = self.accel(h, layer, step)  # the fast path, where it takes this call
            if out is not None:
                return out
        p = self.parts()
        h, x = residual_norm(h, p.attn(h, layer, step, norm=p.input_norm), p.post_attn, p.pre_mlp)
        return residual_norm(h, p.mlp(x), p.post_mlp, None)[0]
