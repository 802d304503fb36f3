"""Checkpoint trails for recurrent cache layers with `rollback: k` (see hybridcache/cache/recurrent/layers.py).

A mixer whose layer asks for m = `layer.trail_length(T)` > 0 interior states hands over the states after each of
the block's last m tokens before the final one. Conv states come straight from the inputs; scan states come from
running the block's last m tokens through the step path (the first T - m through the scan), or for the RG-LRU from
the per-token states the scan computes anyway. With rollback off (the default) none of this runs.
"""

from __future__ import annotations

import torch


def conv_trail(state: torch.Tensor, x: torch.Tensor, m: int) -> torch.Tensor:
    """Conv states [B, m, C, K-1] after each of the last m tokens before the final one.

    state [B, C, K-1]: the inputs before the block; x [B, C, T]: the block's conv inputs (padding already zeroed).
    The state after t tokens is the last K-1 inputs of concat(state, x[..., :t])."""
    k1, t = state.shape[-1], x.shape[-1]
    xs = torch.cat([state.to(x.dtype), x], dim=-1)  # [B, C, K-1+T]
    windows = xs.unfold(-1, k1, 1)  # [B, C, T+1, K-1]: window w = state after w tokens
    return windows[:, :, t - m : t].permute(0, 2, 1, 3).contiguous()  # [B, m, C, K-1]


def stack_trail(states: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[B, ...] states -> [B, m, ...] in the layer's dtype."""
    return torch.stack(states, dim=1).to(dtype)
