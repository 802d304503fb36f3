"""Depthwise causal 1-D convolution with an explicit carried input state.

State convention: ``state`` [B, C, K-1] holds the K-1 inputs that precede
``x`` (oldest first); None means zeros. The returned state is the last K-1
inputs of concat(state, x), so splitting a sequence and passing the state on
is exact. Uses the ``causal_conv1d`` CUDA kernel when available on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import cuda_kernel

_ACTIVATIONS = (None, "silu", "swish")


def _check(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> int:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [C={x.shape[1]}, K], got {tuple(weight.shape)}")
    return weight.shape[1]


def _prefix(x: torch.Tensor, state: torch.Tensor | None, k: int) -> torch.Tensor:
    """The K-1 inputs before x: [B, C, K-1] in x.dtype."""
    if state is None:
        return x.new_zeros(x.shape[0], x.shape[1], k - 1)
    if state.shape[-1] != k - 1:
        raise ValueError(f"state must be [B, C, K-1={k - 1}], got {tuple(state.shape)}")
    return state.to(x.dtype)


def _last_inputs(prefix: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """Last n columns of concat(prefix, x) as a fresh tensor, without concatenating all of x."""
    t = x.shape[-1]
    if t >= n:
        tail = x[..., t - n :]
    else:
        tail = torch.cat([prefix[..., prefix.shape[-1] - (n - t) :], x], dim=-1)
    return tail.clone(memory_format=torch.contiguous_format)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over a sequence.

    Args:
        x: [B, C, T]; weight: [C, K]; bias: [C] or None;
        state: [B, C, K-1] inputs preceding x, or None (= zeros);
        activation: None or "silu" (applied after the bias).

    Returns:
        y [B, C, T] in x.dtype (weights are cast to x.dtype, like a plain
        conv1d in that dtype) and new_state [B, C, K-1] in x.dtype.
    """
    k = _check(x, weight, activation)
    prefix = _prefix(x, state, k)
    new_state = _last_inputs(prefix, x, k - 1)
    w = weight.to(x.dtype)
    b = bias.to(x.dtype) if bias is not None else None

    use_kernel = 2 <= k <= 4 and x.shape[-1] > 0
    kernel = cuda_kernel("causal_conv1d", "causal_conv1d_fn", x) if use_kernel else None
    if kernel is not None:
        # Prepending the state and dropping the first K-1 outputs is exact and
        # avoids the kernel's channel-last-only initial_states path.
        xs = x if state is None else torch.cat([prefix, x], dim=-1)
        y = kernel(xs.contiguous(), w.contiguous(), b, activation=activation)
        return (y if state is None else y[..., k - 1 :]), new_state

    if x.shape[-1] == 0:
        return x.new_zeros(x.shape), new_state
    xs = torch.cat([prefix, x], dim=-1)  # [B, C, K-1+T]
    # The same window-times-weight sum as the decode step, in the same order (so any split rounds alike): K shifted
    # multiply-adds. 10-30x faster than an einsum over unfolded windows, which copies them; CPU depthwise conv1d
    # has no float64 kernel (0.6 s for a tiny float64 block).
    y = _window_sum(xs, w, x.shape[-1])  # [B, C, T]
    if b is not None:
        y = y + b[:, None]
    if activation is not None:
        y = F.silu(y)
    return y, new_state


def _window_sum(xs: torch.Tensor, w: torch.Tensor, t: int) -> torch.Tensor:
    """y[..., c, i] = sum_j xs[..., c, i + j] * w[c, j] for i < t, summed in order j = 0, 1, ... (xs [B, C, K-1+t])."""
    y = xs[..., 0:t] * w[:, 0, None]
    for j in range(1, w.shape[-1]):
        y = torch.addcmul(y, xs[..., j : j + t], w[:, j, None])
    return y


def causal_conv1d_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor | None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step: x [B, C], state [B, C, K-1] -> (y [B, C], new_state [B, C, K-1]).

    Equivalent to ``causal_conv1d(x[..., None], ...)``; never modifies ``state``.
    """
    k = _check(x.unsqueeze(-1), weight, activation)
    prefix = _prefix(x.unsqueeze(-1), state, k)
    w = weight.to(x.dtype)
    b = bias.to(x.dtype) if bias is not None else None

    kernel = cuda_kernel("causal_conv1d", "causal_conv1d_update", x) if 2 <= k <= 4 else None
    if kernel is not None:
        # A width-K buffer works with every causal_conv1d version (old ones require
        # state_len == K, new ones accept state_len >= K-1); it is updated in place.
        buf = torch.cat([prefix.new_zeros(*prefix.shape[:2], 1), prefix], dim=-1).contiguous()
        y = kernel(x, buf, w.contiguous(), b, activation=activation)
        return y, buf[..., 1:].contiguous()

    window = torch.cat([prefix, x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    y = _window_sum(window, w, 1)[..., 0]
    if b is not None:
        y = y + b
    if activation is not None:
        y = F.silu(y)
    return y, window[..., 1:].contiguous()
