"""The cache-layer contract: a frozen spec per layer type and the `CacheLayer` base class.

Every entry of a `Cache` is a `CacheLayer`. It knows how many tokens each batch row has seen (`seen`, padding
excluded) and how many block columns it was fed (`columns`, padding included; shared by all rows). Padding is
left padding only: once a row has a real token, every later token of that row is real. That makes a row's
padding count `columns - seen` constant, and the absolute position of any held column derivable from it.

Every public method validates first and mutates after, so a call that raises leaves the layer unchanged.
Batch operations are split into `_prepare_*` (validate, compute) and `_commit_*` (mutate) so that `Cache` can
validate all of its layers before it changes any.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from hybridcache.cache.errors import CacheError


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


def dtype_nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """Parameters of one cache layer. Tunable fields come from the cache config, the others from the model."""

    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        check_dtype(type(self).__name__, "dtype", self.dtype)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def tunable_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.metadata.get("tunable")}

    @classmethod
    def required_names(cls) -> set[str]:
        return {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }

    def params(self) -> dict[str, Any]:
        """The tunable parameters, as a cache config would write them."""
        return {name: getattr(self, name) for name in sorted(self.tunable_names())}

    def min_nbytes(self, batch: int, tokens: int) -> int:
        """Theoretical minimum bytes after each of `batch` rows has seen `tokens` tokens."""
        raise NotImplementedError

    def held_nbytes(self, batch: int, tokens: int) -> int:
        """Bytes this layer type holds in that situation (differs from the minimum for preallocated storage)."""
        return self.min_nbytes(batch, tokens)


@dataclass(frozen=True)
class LayerSnapshot:
    """A deep copy of one cache layer's state; `restore` puts it back bit-exactly."""

    type_name: str
    spec: LayerSpec
    columns: int
    tensors: Mapping[str, torch.Tensor]


def check_valid_mask(valid: Any, batch: int, tokens: int, seen: torch.Tensor, owner: str) -> torch.Tensor:
    """Validate a block's real-token mask [B, T] (None = all real) and return it as a bool tensor."""
    if valid is None:  # every token real: nothing to check (and no data-dependent branch for torch.compile)
        return torch.ones(batch, tokens, dtype=torch.bool, device=seen.device)
    if not isinstance(valid, torch.Tensor):
        raise CacheError(f"{owner}: the attention mask must be a tensor [B, T], got {type(valid).__name__}")
    if valid.shape != (batch, tokens):
        raise CacheError(f"{owner}: the attention mask has shape {tuple(valid.shape)}, expected {(batch, tokens)}")
    if valid.dtype != torch.bool:
        if valid.dtype.is_floating_point or valid.dtype.is_complex or not ((valid == 0) | (valid == 1)).all():
            raise CacheError(f"{owner}: the attention mask must hold only 0/1 (or bool), got dtype {valid.dtype}")
        valid = valid != 0
    valid = valid.to(seen.device)
    if tokens > 1 and bool((valid[:, 1:] < valid[:, :-1]).any()):
        row = int((valid[:, 1:] < valid[:, :-1]).any(1).nonzero()[0])
        raise CacheError(f"{owner}: row {row} has a padding token after a real token; only left padding is supported")
    started = seen > 0
    if bool((started & ~valid.all(1)).any()):
        row = int((started & ~valid.all(1)).nonzero()[0])
        raise CacheError(
            f"{owner}: row {row} already holds {int(seen[row])} real tokens, so this block cannot contain padding "
            "(left padding comes before a row's first real token)"
        )
    return valid


class CacheLayer(ABC):
    """One entry of a `Cache`. Subclasses are registered with `@register_cache_layer(name)`."""

    type_name: ClassVar[str] = "?"  # set by the registry
    kind: ClassVar[str]  # "attention" or "recurrent"
    spec_cls: ClassVar[type[LayerSpec]]
    _batch_tensors: ClassVar[tuple[str, ...]] = ()  # state tensors whose dim 0 is the batch
    _other_tensors: ClassVar[tuple[str, ...]] = ()  # bookkeeping tensors without a batch dim

    def __init__(self, spec: LayerSpec, batch_size: int, device: torch.device | str | None = None) -> None:
        if not isinstance(spec, self.spec_cls):
            raise CacheError(
                f"cache type '{self.type_name}' needs a {self.spec_cls.__name__}, got {type(spec).__name__}"
            )
        check_positive_int(f"cache type '{self.type_name}'", "batch_size", batch_size)
        self.spec = spec
        self.device = torch.device(device if device is not None else "cpu")
        self.seen = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # real tokens per row
        self.columns = 0  # block columns fed, padding included (the same for every row)
        self._allocate(batch_size)

    # -- what subclasses provide -----------------------------------------------------------------------------
    @abstractmethod
    def _allocate(self, batch_size: int) -> None:
        """Create empty storage for `batch_size` rows."""

    def _prepare_crop(self, n: int) -> Any:
        raise NotImplementedError

    def _commit_crop(self, plan: Any) -> None:
        raise NotImplementedError

    # -- description -------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.seen.shape[0])

    @property
    def name(self) -> str:
        return f"cache layer '{self.type_name}'"

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.spec.params().items())
        return f"{type(self).__name__}({params}; batch={self.batch_size}, columns={self.columns})"

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        names = ("seen",) + self._batch_tensors + self._other_tensors
        return {name: getattr(self, name) for name in names}

    def nbytes(self) -> int:
        """Bytes of cached keys/values/states actually held (underlying storage; bookkeeping excluded)."""
        storages = {}
        for name in self._batch_tensors:
            t = getattr(self, name)
            if t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def min_nbytes(self) -> int:
        """The theoretical minimum for what the rows have seen, from the spec."""
        return sum(self.spec.min_nbytes(1, int(s)) for s in self.seen.tolist())

    # -- reset / batch operations ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything; keep the batch size."""
        self._commit_reset()

    def _commit_reset(self) -> None:
        self.seen = torch.zeros_like(self.seen)
        self.columns = 0
        self._allocate(self.batch_size)

    def _prepare_index(self, index: Any, same_size: bool) -> torch.Tensor:
        what = "reorder" if same_size else "select"
        if not isinstance(index, torch.Tensor):
            try:
                index = torch.as_tensor(index, dtype=torch.long)
            except (TypeError, ValueError) as e:
                raise CacheError(f"{self.name}: {what} index must be a 1-d integer tensor ({e})") from None
        if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise CacheError(f"{self.name}: {what} index must be a 1-d integer tensor, got {index.dtype} {tuple(index.shape)}")
        if index.numel() == 0:
            raise CacheError(f"{self.name}: {what} index is empty")
        if same_size and index.numel() != self.batch_size:
            raise CacheError(f"{self.name}: reorder index has {index.numel()} entries for a batch of {self.batch_size}")
        index = index.to(device=self.device, dtype=torch.long)
        if bool(((index < 0) | (index >= self.batch_size)).any()):
            raise CacheError(f"{self.name}: {what} index {index.tolist()} out of range for a batch of {self.batch_size}")
        return index

    def _commit_index(self, index: torch.Tensor) -> None:
        in_place = index.numel() == self.batch_size  # keep storage addresses stable (static shapes)
        for name in ("seen",) + self._batch_tensors:
            t = getattr(self, name)
            picked = t.index_select(0, index)
            if in_place:
                t.copy_(picked)
            else:
                setattr(self, name, picked)

    def reorder(self, index: Any) -> None:
        """Row i becomes old row index[i] (beam search). Same batch size."""
        self._commit_index(self._prepare_index(index, same_size=True))

    def select(self, index: Any) -> None:
        """Keep the rows in `index` (any length, repeats allowed)."""
        self._commit_index(self._prepare_index(index, same_size=False))

    def _prepare_repeat(self, n: Any) -> torch.Tensor:
        check_positive_int(self.name, "repeat count", n)
        return torch.arange(self.batch_size, device=self.device).repeat_interleave(n)

    def repeat(self, n: int) -> None:
        """Repeat every row n times in place: [a, b] -> [a, a, b, b] for n=2."""
        self._commit_index(self._prepare_repeat(n))

    def _check_crop_length(self, n: Any) -> int:
        if isinstance(n, bool) or not isinstance(n, int):
            raise CacheError(f"{self.name}: crop length must be an int, got {n!r}")
        if n < 0:
            raise CacheError(f"{self.name}: crop length must be >= 0, got {n}")
        if n > self.columns:
            raise CacheError(f"{self.name}: cannot crop to {n} tokens, it holds a sequence of only {self.columns}")
        return n

    def crop(self, n: int) -> None:
        """Truncate the sequence to its first `n` columns (padding included), as if the rest was never fed."""
        self._commit_crop(self._prepare_crop(n))

    # -- snapshot / restore ------------------------------------------------------------------------------------
    def snapshot(self) -> LayerSnapshot:
        tensors = {name: t.clone() for name, t in self._state_tensors().items()}
        return LayerSnapshot(self.type_name, self.spec, self.columns, tensors)

    def _prepare_restore(self, snap: Any) -> LayerSnapshot:
        if not isinstance(snap, LayerSnapshot):
            raise CacheError(f"{self.name}: restore needs a LayerSnapshot, got {type(snap).__name__}")
        if snap.type_name != self.type_name or snap.spec != self.spec:
            raise CacheError(
                f"{self.name}: the snapshot was taken from a '{snap.type_name}' layer with {snap.spec}, "
                f"this layer is '{self.type_name}' with {self.spec}"
            )
        if set(snap.tensors) != set(self._state_tensors()):
            raise CacheError(f"{self.name}: the snapshot holds {sorted(snap.tensors)}, expected {sorted(self._state_tensors())}")
        return snap

    def _commit_restore(self, snap: LayerSnapshot) -> None:
        for name, t in snap.tensors.items():
            current = getattr(self, name)
            if current.shape == t.shape and current.dtype == t.dtype:
                current.copy_(t)  # keep storage addresses stable (static shapes)
            else:
                setattr(self, name, t.clone().to(self.device))
        self.columns = snap.columns

    def restore(self, snap: LayerSnapshot) -> None:
        """Put back the exact state of `snapshot()` (batch size included)."""
        self._commit_restore(self._prepare_restore(snap))
