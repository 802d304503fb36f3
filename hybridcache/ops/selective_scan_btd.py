"""The Mamba block's scan in the layout it holds ([B, T, Dm]): one C kernel call on CPU float32 (through the kernel
seam, ops/kernels.py: eager, or the traced op under torch.compile), otherwise ops/selective_scan.py's scan on
transposed tensors.
"""

from __future__ import annotations

import torch

from hybridcache.ops import kernels
from hybridcache.ops.selective_scan import selective_scan


def selective_scan_btd(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, state=None):
    """`selective_scan` for the layouts the Mamba block holds: u, delta, z [B, T, Dm]; B, C [B, T, N] (the rest as
    there). Float32 on CPU runs one kernel call (hybridcache/accel/native/kernels.py through ops/kernels.py; the
    reference's math in another rounding order, no per-token loop in Python); anything else transposes and calls
    `selective_scan`.
    Returns y [B, T, Dm] in u.dtype and the final state [B, Dm, N]."""
    if (
        kernels.takes(u)
        and u.dim() == 3
        and all(v is None or v.dtype == torch.float32 for v in (delta, z, B, C, A, D, delta_bias, state))
    ):
        out = kernels.call(
            "selective_scan", u, delta, z, B, C, A, D, delta_bias, delta_softplus, state
        )  # eager or traced
        if out is not None:
            return out

    def t(v):
        return None if v is None else v.transpose(1, 2).contiguous()  # [B, C, T]

    y, last = selective_scan(t(u), t(delta), A, t(B), t(C), D, t(z), delta_bias, delta_softplus, state)
    return y.transpose(1, 2), last
