"""LFM2's gated short convolution (models/families/lfm2.py, lfm3.py): in_proj -> B, C, x; y = C * conv(B * x);
out_proj. Its cache is the `conv` type: the last K-1 inputs B * x, [B, D, K-1] per row."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.cache import CacheLayer
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.recurrent.trail import conv_trail
from hybridcache.ops import causal_conv1d, causal_conv1d_step


class ShortConv(nn.Module):
    """LFM2's gated short convolution (HF names): B, C, x = in_proj(h); y = C * causal_conv(B * x); out_proj(y).

    The conv state holds the last K-1 conv inputs (B * x); left padding enters as zeros, so it leaves the state as
    it was (the empty state is zeros too).
    """

    def __init__(self, hidden: int, kernel: int, bias: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, padding=kernel - 1, bias=bias)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.accel = None  # hybridcache.accel's fast path for this mixer, once installed

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        if self.accel is not None:
            out = self.accel(h, layer, step)  # the fast path, where it takes this call
            if out is not None:
                return out
        b, c, x = self.in_proj(h).chunk(3, dim=-1)  # [B, T, D] each
        bx = step.mask_padding(b * x)
        weight, state = self.conv.weight.squeeze(1), layer.states["conv"]  # [D, K], [B, D, K-1]
        if h.shape[1] == 1:
            y, new_state = causal_conv1d_step(bx[:, 0], weight, self.conv.bias, state)  # [B, D]
            y = y[:, None]
        else:
            y, new_state = causal_conv1d(bx.transpose(1, 2), weight, self.conv.bias, state)  # [B, D, T]
            y = y.transpose(1, 2)
        m = layer.trail_length(h.shape[1])  # rollback on: hand over the conv states inside the block too
        trail = {"trail": {"conv": conv_trail(state, bx.transpose(1, 2), m).to(state.dtype)}} if m > 0 else {}
        layer.update(conv=new_state.to(state.dtype), **trail)
        return self.out_proj(c * y)  # [B, T, D]
