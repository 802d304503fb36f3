"""The cache-layer contract: a frozen spec per layer type and the `CacheLayer` base class.

A `CacheLayer` holds storage only (keys/values, states). What the batch has seen lives in one `SequenceState`:
the `Cache`'s, shared by all of its layers, or the layer's own when it is used standalone (tests, notebooks).
Blocks are fed in a transaction: the sequence opens a block (mask validated, positions computed once), every
layer checks it can take it (`check_block`), then stages its writes while the model runs (`update`), and
`commit_block` / `abort_block` make them permanent or drop them. So a call that raises changes nothing.

Every other public method validates first and mutates after. Batch operations are split into `_prepare_*`
(validate, compute) and `_commit_*` (mutate) so that `Cache` can validate all of its layers before it changes any.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.sequence import BlockState, SequenceState, check_crop_length, crop_seen
from hybridcache.cache.core.spec_checks import (  # noqa: F401  (re-exported: specs and layers import them from here)
    check_dtype,
    check_float_dtype,
    check_positive_int,
    check_row_index,
    dtype_nbytes,
    tunable,
)


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """Parameters of one cache layer. Tunable fields come from the cache config, the others from the model."""

    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        check_float_dtype(type(self).__name__, "dtype", self.dtype)

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
    """A deep copy of one cache layer's storage and of the sequence state; `restore` puts it back bit-exactly."""

    type_name: str
    spec: LayerSpec
    columns: int
    seen: torch.Tensor  # [B]
    tensors: Mapping[str, torch.Tensor]


class CacheLayer(ABC):
    """One entry of a `Cache`. Subclasses are registered with `@register_cache_layer(name)`.

    `exact = True` promises: feeding a sequence in any split gives the same attention inputs (or states) as
    feeding it at once, so cached generation equals the full recompute with the same pattern. Lossy types
    (quantized storage, score-based eviction) set it False and document their bound.
    """

    type_name: ClassVar[str] = "?"  # set by the registry
    kind: ClassVar[str]  # "attention" or "recurrent"
    spec_cls: ClassVar[type[LayerSpec]]
    exact: ClassVar[bool] = True
    example_params: ClassVar[Mapping[str, Any]] = {}  # tunable parameters the conformance kit tries the type with
    example_native: ClassVar[Mapping[str, Any] | None] = None  # model-side shapes for the kit (recurrent types)
    _batch_tensors: ClassVar[tuple[str, ...]] = ()  # storage tensors whose dim 0 is the batch
    _other_tensors: ClassVar[tuple[str, ...]] = ()  # bookkeeping tensors without a batch dim

    def __init__(
        self,
        spec: LayerSpec,
        batch_size: int,
        device: torch.device | str | None = None,
        *,
        sequence: SequenceState | None = None,
    ) -> None:
        if not isinstance(spec, self.spec_cls):
            raise CacheError(
                f"cache type '{self.type_name}' needs a {self.spec_cls.__name__}, got {type(spec).__name__}"
            )
        check_positive_int(f"cache type '{self.type_name}'", "batch_size", batch_size)
        self.spec = spec
        self.device = torch.device(device if device is not None else "cpu")
        self.standalone = sequence is None  # a standalone layer owns its sequence state
        if sequence is None:
            sequence = SequenceState(batch_size, self.device)
        elif sequence.batch_size != batch_size:
            raise CacheError(f"{self.name}: batch size {batch_size} but the sequence state has {sequence.batch_size}")
        self.seq = sequence
        self._staged: Any = None  # what this layer wrote for the open block; None: not fed yet
        self._allocate(batch_size)

    # -- what subclasses provide -----------------------------------------------------------------------------
    @abstractmethod
    def _allocate(self, batch_size: int) -> None:
        """Create empty storage for `batch_size` rows."""

    def check_block(self, block: BlockState) -> None:
        """Raise (changing nothing) if this layer cannot take `block` (capacity of preallocated storage, ...)."""
        self.check_capacity(block.seen_after)

    def check_capacity(self, seen_after: torch.Tensor) -> None:
        """Raise if this layer cannot hold `seen_after` [B] real tokens per row (preallocated storage)."""

    def _commit_staged(self, staged: Any) -> None:
        """Make the writes staged by `update` permanent (called once per block, after every layer was fed)."""

    def _abort_staged(self, staged: Any) -> None:
        """Drop the writes staged by `update` (the block failed)."""

    def _prepare_crop(self, n: int, seen: torch.Tensor) -> Any:
        raise NotImplementedError

    def _commit_crop(self, plan: Any) -> None:
        raise NotImplementedError

    # -- a storage tier (offload): where a layer's parts live between blocks -----------------------------------
    _tier: Any = None  # None: the parts stay on self.device; else an object with fetch() / park() / release()

    def _fetch(self) -> None:
        """Bring offloaded parts to the compute device (before a block or a batch operation uses them)."""
        if self._tier is not None:
            self._tier.fetch()

    def _park(self) -> None:
        """Put offloaded parts back on their storage tier (after the commit or operation)."""
        if self._tier is not None:
            self._tier.park()

    # -- description -------------------------------------------------------------------------------------------
    @property
    def seen(self) -> torch.Tensor:
        """Real tokens per row [B] (read-only view of the sequence state)."""
        return self.seq.seen

    @property
    def columns(self) -> int:
        """Block columns fed so far, padding included."""
        return self.seq.columns

    @property
    def batch_size(self) -> int:
        return self.seq.batch_size

    @property
    def name(self) -> str:
        return f"cache layer '{self.type_name}'"

    @property
    def is_exact(self) -> bool:
        """Whether this layer, as configured (storage included), is exact."""
        return self.exact

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.spec.params().items())
        return f"{type(self).__name__}({params}; batch={self.batch_size}, columns={self.columns})"

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._batch_tensors + self._other_tensors}

    def nbytes(self) -> int:
        """Bytes of cached keys/values/states actually held (underlying storage; bookkeeping excluded)."""
        storages = {}
        for name in self._batch_tensors:
            t = getattr(self, name)
            if t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def spare_nbytes(self) -> int:
        """Bytes allocated beyond what `nbytes()` holds (spare slots that appends fill in place); 0 by default."""
        return 0

    def min_nbytes(self) -> int:
        """The theoretical minimum for what the rows have seen, from the spec."""
        return sum(self.spec.min_nbytes(1, int(s)) for s in self.seen.tolist())

    # -- feeding a block ---------------------------------------------------------------------------------------
    def _open(self, valid: Any, tokens: int) -> tuple[BlockState, bool]:
        """The block this update belongs to: the Cache's open block, or (standalone) one opened for this call."""
        block = self.seq.block
        if block is not None:
            if valid is not None and not (isinstance(valid, int) and valid == block.tokens):
                raise CacheError(f"{self.name}: the block's mask was already given when the block was opened")
            if tokens != block.tokens:
                raise CacheError(f"{self.name}: got {tokens} tokens, the open block has {block.tokens}")
            if self._staged is not None:
                raise CacheError(f"{self.name}: this layer was already fed in the open block")
            return block, False
        if not self.standalone:
            raise CacheError(
                f"{self.name} belongs to a Cache, which owns the sequence state: feed it through the model, or "
                "inside `with cache.block(mask):` (so every layer advances together)"
            )
        if isinstance(valid, int) and not isinstance(valid, bool):
            if valid != tokens:
                raise CacheError(f"{self.name}: valid={valid} tokens, but the block has {tokens}")
            valid = None
        block = self.seq.make_block(valid, tokens, self.name)
        self.check_block(block)
        self.seq.block = block
        return block, True

    def _close(self, opened: bool, failed: bool) -> None:
        if not opened:
            return
        if failed:
            self.abort_block()
            self.seq.block = None
        else:
            self.commit_block()
            self.seq.commit()

    @property
    def fed(self) -> bool:
        """Whether this layer has staged writes for the open block."""
        return self._staged is not None

    def commit_block(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            self._commit_staged(staged)

    def abort_block(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            self._abort_staged(staged)

    # -- reset / batch operations ------------------------------------------------------------------------------
    def _check_standalone(self, what: str) -> None:
        if not self.standalone:
            raise CacheError(f"{self.name} belongs to a Cache: call cache.{what}() so every layer changes together")
        if self.seq.block is not None:
            raise CacheError(f"{self.name}: cannot {what} while a block is being fed")

    def reset(self) -> None:
        """Forget everything; keep the batch size."""
        self._check_standalone("reset")
        self._commit_reset()
        self.seq.seen, self.seq.columns = torch.zeros_like(self.seq.seen), 0
        self.seq.fingerprint = torch.zeros_like(self.seq.seen)

    def _commit_reset(self) -> None:
        self._allocate(self.batch_size)

    def _prepare_index(self, index: Any, same_size: bool) -> torch.Tensor:
        what = "reorder" if same_size else "select"
        return check_row_index(index, self.batch_size, what, self.name, same_size).to(self.device)

    def _commit_index(self, index: torch.Tensor) -> None:
        in_place = index.numel() == self.batch_size  # keep storage addresses stable (static shapes)
        for name in self._batch_tensors:
            t = getattr(self, name)
            picked = t.index_select(0, index)
            if in_place:
                t.copy_(picked)
            else:
                setattr(self, name, picked)

    def _standalone_index(self, index: torch.Tensor) -> None:
        self._commit_index(index)
        self.seq.seen = self.seq.seen.index_select(0, index)

    def reorder(self, index: Any) -> None:
        """Row i becomes old row index[i] (beam search). Same batch size."""
        self._check_standalone("reorder")
        self._standalone_index(self._prepare_index(index, same_size=True))

    def select(self, index: Any) -> None:
        """Keep the rows in `index` (any length, repeats allowed)."""
        self._check_standalone("select")
        self._standalone_index(self._prepare_index(index, same_size=False))

    def _prepare_repeat(self, n: Any) -> torch.Tensor:
        check_positive_int(self.name, "repeat count", n)
        return torch.arange(self.batch_size, device=self.device).repeat_interleave(n)

    def repeat(self, n: int) -> None:
        """Repeat every row n times in place: [a, b] -> [a, a, b, b] for n=2."""
        self._check_standalone("repeat")
        self._standalone_index(self._prepare_repeat(n))

    def crop(self, n: int) -> None:
        """Truncate the sequence to its first `n` columns (padding included), as if the rest was never fed."""
        self._check_standalone("crop")
        n = check_crop_length(n, self.columns, self.name)
        seen = crop_seen(self.seq, n)
        self._commit_crop(self._prepare_crop(n, seen))
        self.seq.seen, self.seq.columns = seen, n

    # -- snapshot / restore ------------------------------------------------------------------------------------
    def snapshot(self) -> LayerSnapshot:
        tensors = {name: t.clone() for name, t in self._state_tensors().items()}
        return LayerSnapshot(self.type_name, self.spec, self.columns, self.seen.clone(), tensors)

    def _prepare_restore(self, snap: Any) -> LayerSnapshot:
        if not isinstance(snap, LayerSnapshot):
            raise CacheError(f"{self.name}: restore needs a LayerSnapshot, got {type(snap).__name__}")
        if snap.type_name != self.type_name or snap.spec != self.spec:
            raise CacheError(
                f"{self.name}: the snapshot was taken from a '{snap.type_name}' layer with {snap.spec}, "
                f"this layer is '{self.type_name}' with {self.spec}"
            )
        current = self._state_tensors()
        if set(snap.tensors) != set(current):
            raise CacheError(f"{self.name}: the snapshot holds {sorted(snap.tensors)}, expected {sorted(current)}")
        rows = snap.seen.shape[0]
        for name, t in snap.tensors.items():
            if not isinstance(t, torch.Tensor) or t.dtype != current[name].dtype or t.dim() != current[name].dim():
                raise CacheError(f"{self.name}: snapshot tensor '{name}' does not match this layer's storage")
            if t.is_meta:
                raise CacheError(f"{self.name}: snapshot tensor '{name}' is on the meta device (no values to restore)")
            if name in self._batch_tensors and t.shape[0] != rows:
                raise CacheError(
                    f"{self.name}: snapshot tensor '{name}' has {t.shape[0]} rows, its sequence state has {rows}"
                )
        return snap

    def _commit_restore(self, snap: LayerSnapshot) -> None:
        for name, t in snap.tensors.items():
            current = getattr(self, name)
            if current.shape == t.shape and current.dtype == t.dtype:
                current.copy_(t)  # keep storage addresses stable (static shapes)
            else:
                setattr(self, name, t.clone().to(self.device))

    def restore(self, snap: LayerSnapshot) -> None:
        """Put back the exact state of `snapshot()` (batch size included)."""
        self._check_standalone("restore")
        self._commit_restore(self._prepare_restore(snap))
        self.seq.seen, self.seq.columns = snap.seen.clone().to(self.device), snap.columns
