"""A mixture-of-experts block's routed experts for one decode token as one C call (csrc/moe_step.c): GPT-OSS's fused
experts. The router runs before, in torch; this takes its choice (expert indices and weights). Returns None (the
caller's reference path) for what the kernel does not take (not float32 CPU eager, no kernels built) and raises
KernelArgumentError for sizes that do not fit together or an expert index out of range, before any C call.
"""

from __future__ import annotations

import ctypes

import torch

from hybridcache.accel.native.checks import INT_MAX, KernelArgumentError, _eager, _real
from hybridcache.accel.native.library import _library

_F32 = torch.float32


def _dense(t: torch.Tensor) -> bool:
    return t.dtype == _F32 and t.is_cpu and t.layout == torch.strided and t.is_contiguous()


def oss_experts_step(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor | None:
    """GPT-OSS's experts on one token: x [1, D], index [1, k] (int64, each in [0, E)), weights [1, k], gate_up
    [E, D, 2I] (gate and up interleaved by column), its bias [E, 2I], down [E, I, D], its bias [E, D], the swiglu's
    alpha and limit -> sum over the slots of weight * expert(x) [1, D]."""
    lib = _library()
    if lib is None or not all(isinstance(t, torch.Tensor) for t in (x, index, weights, gate_up, down)):
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[2] % 2:
        raise KernelArgumentError("oss experts: gate_up must be [E, D, 2I] and down [E, I, D]")
    e, d, i = gate_up.shape[0], gate_up.shape[1], gate_up.shape[2] // 2
    if tuple(down.shape) != (e, i, d) or not 0 < e * d * 2 * i <= INT_MAX or not 0 < 3 * i + d <= INT_MAX:
        raise KernelArgumentError(f"oss experts: down must be [{e}, {i}, {d}], got {list(down.shape)}")
    if not all(isinstance(b, torch.Tensor) and tuple(b.shape) == s for b, s in ((gate_up_bias, (e, 2 * i)),
                                                                                 (down_bias, (e, d)))):  # fmt: skip
        raise KernelArgumentError(f"oss experts: the biases must be [{e}, {2 * i}] and [{e}, {d}]")
    if not (_real(alpha) and _real(limit)):
        raise KernelArgumentError("oss experts: alpha and limit must be real numbers")
    if not _eager(x) or tuple(x.shape) != (1, d) or index.dim() != 2 or index.shape[0] != 1:
        return None
    k = index.shape[1]
    if tuple(weights.shape) != (1, k) or index.dtype != torch.int64 or not 1 <= k <= e:
        raise KernelArgumentError(f"oss experts: index [1, k] (int64) and weights [1, k] with 1 <= k <= {e}")
    chosen = index[0].tolist()
    if not all(0 <= c < e for c in chosen):
        raise KernelArgumentError(f"oss experts: expert index out of [0, {e}): {chosen}")
    if not all(_dense(t) for t in (x, weights, gate_up, gate_up_bias, down, down_bias)):
        return None
    y, scratch = torch.empty(1, d, dtype=_F32), torch.empty(3 * i + d, dtype=_F32)
    lib.hc_oss_experts_step(
        x.data_ptr(), d, i, k, (ctypes.c_int * k)(*chosen), weights.data_ptr(), gate_up.data_ptr(),
        gate_up_bias.data_ptr(), down.data_ptr(), down_bias.data_ptr(), float(alpha), float(limit),
        scratch.data_ptr(), y.data_ptr(),
    )  # fmt: skip
    return y
