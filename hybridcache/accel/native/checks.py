"""What every C kernel wrapper checks before a call: limits, and the cheap predicates on tensors and numbers.

The wrappers (cpu_rows.py, cpu_attention.py, cpu_fused.py) order these cheapest first, since they run once per
projection / norm / layer of every decode step; the declared rules of each op (op_declarations.py) are checked by
registry.py with the same predicates.
"""

from __future__ import annotations

import torch

MAX_ROWS = 16  # more rows than this: a real GEMM, where the BLAS is better
MAX_NORM_ROWS = 1 << 20  # rows per norm call (a prefill block of 1M tokens); split over threads when big
INT_MAX = 2**31 - 1  # every size a kernel takes is a C int; every tensor it reads or writes has fewer elements
_F32, _STRIDED = torch.float32, torch.strided


class KernelArgumentError(ValueError):
    """Arguments that no implementation takes (e.g. a chunk size of 0, an unknown pattern, a wrong dtype or shape
    for a registered op), refused before any kernel runs. Anything valid that a kernel does not take goes to the
    torch path instead (the wrapper's None)."""


def _eager(x: torch.Tensor) -> bool:
    """A strided float32 CPU tensor, no autograd, not being traced by torch.compile (a kernel call writes through raw
    pointers, which a trace would run on placeholder tensors; a trace calls the registered op instead): what every
    wrapper here needs first."""
    return (
        x.dtype == _F32
        and x.is_cpu
        and x.layout == _STRIDED
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


def _cpu(t: torch.Tensor, dtype: torch.dtype = _F32) -> bool:
    """A strided CPU tensor of `dtype`: what a kernel may read through its data pointer (its sizes: checked by the
    caller against the sizes it passes)."""
    return t.dtype == dtype and t.is_cpu and t.layout == _STRIDED


def _vec(t: torch.Tensor | None, n: int) -> bool:
    """None, or a contiguous strided float32 CPU vector of n (n a C int: the caller's size)."""
    return t is None or (
        t.dtype == _F32 and t.shape == (n,) and t.is_cpu and t.layout == _STRIDED and t.is_contiguous()
    )


def _q8_scale(t: torch.Tensor | None, rows: int, cols: int) -> bool:
    """A q8_0 weight's scale: a contiguous strided float16 CPU tensor [rows, cols / 32], cols a multiple of 32."""
    return (
        t is not None
        and cols % 32 == 0
        and t.dtype == torch.float16
        and t.shape == (rows, cols // 32)
        and t.is_cpu
        and t.layout == _STRIDED
        and t.is_contiguous()
    )


def _ints(*sizes: int) -> bool:
    """Whether every size fits a C int."""
    return all(0 <= v <= INT_MAX for v in sizes)


def _real(v) -> bool:
    """A Python / numpy real number a C float takes (eps, scale, softcap)."""
    return type(v) is float or isinstance(v, (int, float)) and not isinstance(v, bool)


def _dense_last(x: torch.Tensor) -> bool:
    """Whether the last dim is contiguous (a size-1 dim may have any stride)."""
    return x.shape[-1] <= 1 or x.stride(-1) == 1


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()
