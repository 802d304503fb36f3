"""A bound kernel call (fused.py `bind_*`), kept while the modules it was bound to stay the same.

A decode step calls each layer's fused kernels with the same weights and norms every time; checking them and
building their C arguments again each step cost more than half of the interpreter time between Gemma 3's kernels.
The fast path keeps the call bound to them in a KernelMemo under a key of everything the binding read: each tensor's
identity, address, dtype, shape and strides (a replaced parameter, `model.to(...)`, a `.data` swap all change it),
each norm's weight version (its effective scale is derived from the values) and eps, the sizes. A changed key binds
again; the bound call holds the tensors it points C at, so an identity in a key is never reused while it is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from hybridcache.nn.core.norms import RMSNorm, _weight

_UNSET = object()


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a binding relies on about `t`: its identity, address, dtype, shape and strides (None for none)."""
    return None if t is None else (id(t), t.data_ptr(), t.dtype, t.shape, t.stride())


def norm_key(norm: nn.Module | None) -> tuple | None:
    """What kernel_plain / kernel_args (nn/core/norms.py) read from `norm`, for a bound call's key: the module,
    its kind, its weight (identity, address, dtype, shape, version: the effective scale derives from the values)
    and eps."""
    if type(norm) is not RMSNorm:
        return None if norm is None else (id(norm), type(norm))  # another kind: kernel_plain refuses it
    w = _weight(norm)
    return id(norm), type(norm), norm.unit_offset, norm.eps, tensor_key(w), w._version


class KernelMemo:
    """One bound call (or None: the kernel does not take these) under the key it was bound for."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: tuple[Any, Callable | None] = (_UNSET, None)  # (key, call): one object, replaced at once

    def get(self, key: Hashable, bind: Callable[[], Callable | None]) -> Callable | None:
        entry = self.entry
        if entry[0] != key:
            entry = self.entry = (key, bind())
        return entry[1]

    # a copied or pickled model binds its own tensors: a copy starts empty
    def __deepcopy__(self, memo: dict) -> KernelMemo:
        return KernelMemo()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.entry = (_UNSET, None)
