"""A block's bound kernel call (accel/fused.py `bind_*`), kept while what it was bound to stays the same.

A decode step calls each layer's fused kernels with the same weights and norms every time; checking them and
building their C arguments again each step cost more than half of the interpreter time between Gemma 3's kernels.
A block keeps the call bound to them in a KernelMemo under a key of everything the binding read: each tensor's
identity, address, dtype, shape and strides (a replaced parameter, `model.to(...)`, a `.data` swap all change it),
each norm's weight version (its effective scale is derived from the values) and eps, the sizes. A changed key binds
again; the bound call holds the tensors it points C at, so an identity in a key is never reused while it is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

_UNSET = object()


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a binding relies on about `t`: its identity, address, dtype, shape and strides (None for none)."""
    return None if t is None else (id(t), t.data_ptr(), t.dtype, t.shape, t.stride())


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
