"""Argument checks shared by cache specs and layers: positive ints, dtypes, row indices; and `tunable` fields."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

import torch

from hybridcache.cache.core.errors import CacheError


def tunable(default: Any = dataclasses.MISSING) -> Any:
    """A spec field that a cache config may set (window, chunk_size, max_length, ...)."""
    return field(default=default, metadata={"tunable": True})


def check_positive_int(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CacheError(f"{owner}: {name} must be a positive integer, got {value!r}")


def check_dtype(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, torch.dtype):
        raise CacheError(f"{owner}: {name} must be a torch.dtype, got {value!r}")


def check_float_dtype(owner: str, name: str, value: Any) -> None:
    """A storage dtype for keys, values or states: a floating-point torch.dtype (integers would truncate)."""
    check_dtype(owner, name, value)
    if not value.is_floating_point:
        raise CacheError(f"{owner}: {name} must be a floating-point dtype, got {value}")


def dtype_nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _index_dtype_ok(index: torch.Tensor) -> bool:
    return index.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def check_row_index(index: Any, batch: int, what: str, owner: str, same_size: bool) -> torch.Tensor:
    """A 1-d integer row index in [0, batch) (no floats, no bools: they would be truncated or mean a mask)."""
    if not isinstance(index, torch.Tensor):
        items = index if isinstance(index, (list, tuple)) else None
        if items is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise CacheError(f"{owner}: {what} index must be a 1-d integer tensor or a list of ints, got {index!r}")
        if any(not 0 <= i < batch for i in items):  # before torch.tensor: a value past int64 would overflow there
            raise CacheError(f"{owner}: {what} index {list(items)} out of range for a batch of {batch}")
        index = torch.tensor(items, dtype=torch.long)
    if index.dim() != 1 or not _index_dtype_ok(index):
        raise CacheError(f"{owner}: {what} index must be a 1-d integer tensor, got {index.dtype} {tuple(index.shape)}")
    if index.is_meta:
        raise CacheError(f"{owner}: {what} index is on the meta device (a shape without values)")
    if index.numel() == 0:
        raise CacheError(f"{owner}: {what} index is empty")
    if same_size and index.numel() != batch:
        raise CacheError(f"{owner}: reorder index has {index.numel()} entries for a batch of {batch}")
    index = index.long()
    if bool(((index < 0) | (index >= batch)).any()):
        raise CacheError(f"{owner}: {what} index {index.tolist()} out of range for a batch of {batch}")
    return index
