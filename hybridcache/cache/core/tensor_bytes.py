"""A tensor's bytes in row-major order, whatever its strides: what the save file and the identity hashes read.

`Tensor.contiguous()` is not enough: a size-1 dimension may carry any stride and still count as contiguous (the
fingerprint of a batch-1 cache is `running[:, -1]`, shape [1] with stride [T]), and `view(torch.uint8)` refuses a
last stride other than 1."""

from __future__ import annotations

import numpy as np
import torch


def standard_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` detached on the CPU with row-major strides (itself when it already has them, else a copy)."""
    t = t.detach().cpu()
    if t.stride() == standard_strides(tuple(t.shape)):
        return t
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of `t` (row-major) as a uint8 array: a view of `t` when its strides allow, else of a copy."""
    return dense(t).reshape(-1).view(torch.uint8).numpy()
