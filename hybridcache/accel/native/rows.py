"""The C kernels of a decode step's row-wise work (kernels/cpu_decode.c): projections (weights streamed once for all
rows, bfloat16 / int8 widened in registers), RMSNorm, the residual add between two norms, a gated MLP's
activation x product, argmax over the vocabulary. Each returns None (the caller's torch path) for anything its
kernel does not take; see kernels.py.
"""

from __future__ import annotations

import torch

from hybridcache.accel.native.checks import (
    INT_MAX,
    MAX_NORM_ROWS,
    MAX_ROWS,
    _cpu,
    _eager,
    _ints,
    _ptr,
    _q8_scale,
    _real,
    _vec,
)
from hybridcache.accel.native.library import _library
from hybridcache.accel.native.op_declarations import ACT_MUL, GEMM_KERNELS, WEIGHT_KERNELS


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `decode_linear` takes these (CPU, float32 x of at least one row, a 2-d weight it reads)."""
    return (
        _eager(x)
        and x.dim() >= 1
        and _cpu(weight, weight.dtype)
        and weight.dim() == 2
        and weight.dtype in WEIGHT_KERNELS
        and x.shape[-1] == weight.shape[1]
        and _ints(*weight.shape)
        and 0 < x.numel() // max(x.shape[-1], 1) <= INT_MAX
    )


# The wrappers below run once per projection / norm / layer of every decode step: checks are ordered cheapest first
# and each returns None (the caller's torch path) for anything its kernel does not take.


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x [..., K] @ weight[N, K]^T (* scale [N]) (+ bias [N]) -> [..., N] float32, by the kernels: up to MAX_ROWS rows
    (a decode step) the weight-streaming kernel, more (a prefill) the GEMM kernel, which widens bfloat16 / int8
    weights panel by panel (never the whole matrix). None when the kernels cannot take these tensors (see `supports`;
    contiguous float32 scale / bias of N), are unavailable, or the GEMM's scratch cannot be allocated."""
    if not _eager(x) or x.dim() == 0:
        return None
    lib = _library()
    name = WEIGHT_KERNELS.get(weight.dtype)
    if (
        lib is None
        or name is None
        or weight.dim() != 2
        or not weight.is_cpu
        or weight.layout != torch.strided
        or not weight.is_contiguous()
    ):
        return None
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if x.shape[-1] != k or not 0 < rows <= INT_MAX or n > INT_MAX or k > INT_MAX:
        return None
    if not (_vec(scale, n) and _vec(bias, n)):
        return None
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    failed = getattr(lib, name if rows <= MAX_ROWS else GEMM_KERNELS[weight.dtype])(
        x.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        None if scale is None else scale.data_ptr(),
        None if bias is None else bias.data_ptr(),
        rows,
        n,
        k,
    )
    return None if failed else out


def decode_linear_q8_0(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor
) -> torch.Tensor | None:
    """x [..., K] @ (q8_0 weight int8 [N, K], float16 scale [N, K / 32])^T (+ bias [N]) -> [..., N] float32 with x
    quantized per block of 32 (hc_linear_q8_0, any number of rows); None when the kernel does not take these."""
    if not _eager(x) or x.dim() == 0:
        return None
    lib = _library()
    if (
        lib is None
        or not _cpu(weight, torch.int8)
        or weight.dim() != 2
        or not weight.is_contiguous()
        or x.shape[-1] != weight.shape[1]
    ):
        return None
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if not (0 < rows and _ints(n, k, rows * k) and _q8_scale(scale, n, k) and _vec(bias, n)):
        return None
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.hc_linear_q8_0(x.data_ptr(), weight.data_ptr(), out.data_ptr(), scale.data_ptr(), _ptr(bias), rows, n, k)
    return out


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., D] * rsqrt(mean(x^2) + eps) * scale [D] in float32 (a norm's effective scale, e.g. 1 + weight); None
    when the kernel does not take these (not float32 CPU, autograd on, more than MAX_NORM_ROWS rows)."""
    if not _eager(x) or x.dim() == 0 or not _real(eps):
        return None
    lib = _library()
    d = x.shape[-1]
    if lib is None or scale is None or not _vec(scale, d) or not 0 < x.numel() <= min(MAX_NORM_ROWS * d, INT_MAX):
        return None
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    lib.hc_rms_norm(x.data_ptr(), scale.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
    return out


def residual_norm(
    h: torch.Tensor, x: torch.Tensor, post: tuple[torch.Tensor, float] | None, nxt: tuple[torch.Tensor, float] | None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """h + rms_norm(x) * post scale (x itself when `post` is None), and the RMSNorm of that sum by `nxt` (None: not
    computed): a residual add between two norms in one call. `post` / `nxt`: (effective scale [D], eps). None when
    the kernel does not take these (h and x [..., D] float32 of one shape)."""
    if not _eager(x) or not _eager(h) or h.shape != x.shape or x.dim() == 0:
        return None
    lib = _library()
    d = x.shape[-1]
    for norm in (post, nxt):
        if norm is not None and (norm[0] is None or not _vec(norm[0], d) or not _real(norm[1])):
            return None
    if lib is None or not 0 < x.numel() <= min(MAX_NORM_ROWS * d, INT_MAX):
        return None
    h, x = h.contiguous(), x.contiguous()
    h_out = torch.empty_like(h)
    n_out = None if nxt is None else torch.empty_like(h)
    lib.hc_residual_norm(
        h.data_ptr(),
        x.data_ptr(),
        None if post is None else post[0].data_ptr(),
        0.0 if post is None else post[1],
        None if nxt is None else nxt[0].data_ptr(),
        0.0 if nxt is None else nxt[1],
        h_out.data_ptr(),
        None if n_out is None else n_out.data_ptr(),
        x.numel() // d,
        d,
    )
    return h_out, n_out


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
    """act(gate) * up from a fused gate / up projection [..., 2I] (gate first) -> [..., I], for the activations in
    ACT_MUL; None when the kernel does not take these."""
    code = ACT_MUL.get(act) if isinstance(act, str) else None
    if code is None or not _eager(gate_up) or gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        return None
    lib = _library()
    two_i = gate_up.shape[-1]
    if lib is None or not 0 < gate_up.numel() <= min(MAX_NORM_ROWS * two_i, INT_MAX):
        return None
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], two_i // 2, dtype=torch.float32)
    lib.hc_act_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // two_i, two_i // 2, code)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x [B, V].argmax(-1) as torch computes it (the first largest; the first NaN if any) by the kernel: ~20x faster
    than torch on a 262k-token vocabulary (0.44 ms per row there). None when the kernel does not take x."""
    if not _eager(x) or x.dim() != 2 or not 0 < x.shape[1] or x.shape[0] == 0 or x.numel() > INT_MAX:
        return None
    lib = _library()
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.hc_argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out
