"""Shared helpers: lazy optional-kernel loading and accumulation dtype.

The CUDA kernels (``mamba_ssm``, ``causal_conv1d``) are optional. They are
imported lazily, at most once per symbol, and only when an op is called with
CUDA tensors; on CPU machines their import is never attempted. Setting the
environment variable ``HYBRIDCACHE_DISABLE_KERNELS=1`` (before the first call)
forces the pure-torch paths everywhere.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

import torch

DISABLE_ENV = "HYBRIDCACHE_DISABLE_KERNELS"


def kernels_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


@functools.cache
def load_kernel(module: str, name: str) -> Callable | None:
    """``module.name`` if importable (and kernels not disabled), else None. Cached."""
    if kernels_disabled():
        return None
    try:
        mod = importlib.import_module(module)
    except (ImportError, OSError, RuntimeError):  # missing package / broken CUDA libs
        return None
    return getattr(mod, name, None)


def cuda_kernel(module: str, name: str, *tensors: torch.Tensor | None) -> Callable | None:
    """The kernel ``module.name`` iff every given tensor is on CUDA and it imports."""
    if not all(t is None or t.is_cuda for t in tensors):
        return None
    return load_kernel(module, name)


def acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (recurrences never run in half precision)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32
