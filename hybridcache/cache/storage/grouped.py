"""Layer-level KV storages whose stored integers depend on which tokens were quantized together (KIVI, HF's
QuantizedCache): a quantized history plus a dense recent tail, with their own flush rule.

Per-token codecs (kv_codecs.py) cannot express these: KIVI groups keys per channel over G tokens, and HF's cache
re-quantizes everything it holds when its residual buffer fills. So such a format owns the layer's keys and values
as a whole. The storage is column-aligned across batch rows, like both references: column c is the c-th token fed to
the layer (padding included, position -1), a flush moves whole columns, and a row's positions only feed the mask.

The narrow interface an attention cache layer calls (validate, then mutate):
    staged = storage.prepare(k, v, pos)        # pure: the block's view + the next state; raises CacheError
    staged.keys, staged.values, staged.pos     # what the block attends to [B, H, S, D], [B, S]
    storage.commit(staged, keep)               # install the next state; drop what `keep` says no row needs
    storage.nbytes(), .select(index), .crop(columns), .state() / .load_state(...)
`keep(pos [B, S]) -> bool [S]` says which held columns some row's next query can still see (a suffix for the
built-in patterns); each format decides at which granularity it lets them go.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.cache.core.errors import CacheConfigError, CacheError

Keep = Callable[[torch.Tensor], torch.Tensor]  # held positions [B, S] -> columns still needed [S]


def minmax_quantize(x: torch.Tensor, bits: int, dim: int | tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Asymmetric min-max quantization of x over `dim` (the group): (codes uint8 like x, scale, minimum).

    scale = (max - min) / (2^bits - 1), code = round((x - min) / scale) clamped to [0, 2^bits - 1]; a constant
    group (scale 0) gets code 0, which decodes to its minimum, i.e. exactly. The arithmetic is the references'.
    """
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    codes = torch.round((x - lo) / scale).clamp(0, 2**bits - 1)
    codes = torch.where(scale == 0, 0.0, codes).to(torch.uint8)  # 0 / 0 would be NaN
    return codes, scale, lo


def minmax_dequantize(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """codes * scale + minimum in the scale's dtype (two roundings, no fused multiply-add, as the references)."""
    return codes.to(scale.dtype) * scale + lo


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [.., D] of `bits` bits -> [.., D * bits / 8] bytes (element j of a byte at bits * j)."""
    per = 8 // bits
    parts = codes.unflatten(-1, (-1, per))  # [.., D / per, per]
    out = parts[..., 0].clone()
    for j in range(1, per):
        out |= parts[..., j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: [.., D * bits / 8] bytes -> uint8 codes [.., D]."""
    mask = 2**bits - 1
    return torch.stack([(packed >> (bits * j)) & mask for j in range(8 // bits)], dim=-1).flatten(-2)


def check_bits(owner: str, bits: Any, head_dim: int) -> None:
    if bits not in (2, 4):
        raise CacheConfigError(f"{owner}: nbits must be 2 or 4, got {bits!r}")
    if head_dim % (8 // bits):
        raise CacheConfigError(
            f"{owner}: {bits}-bit codes are packed {8 // bits} per byte along head_dim, which "
            f"must be a multiple of {8 // bits}; got {head_dim}"
        )


def is_count(n: Any, minimum: int = 1) -> bool:
    """n is an integer (not a bool) >= minimum: the check behind every group size and residual length."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= minimum


def tensor_nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Staged:
    """A prepared block: what it attends to, and the storage's state once it is committed."""

    keys: torch.Tensor  # [B, H, S, D]
    values: torch.Tensor  # [B, H, S, D]
    pos: torch.Tensor  # [B, S]: positions of the view's columns (-1: padding)
    state: dict[str, Any]  # the next state (tensors and ints), as `state()` returns it


class GroupedKVStorage(ABC):
    """Keys and values of one attention cache layer as a quantized history and a dense tail (see module doc)."""

    unbatched: tuple[str, ...] = ()  # state tensors whose dim 0 is not the batch (groups across rows)

    def __init__(
        self, batch: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.batch, self.heads, self.head_dim = batch, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self._state = self.empty_state()

    # -- what a format defines --------------------------------------------------------------------------------
    @abstractmethod
    def empty_state(self) -> dict[str, Any]:
        """The state of a layer that has seen nothing."""

    @abstractmethod
    def prepare(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> Staged:
        """A block k, v [B, H, T, D] at positions pos [B, T]: the view and the next state. Changes nothing."""

    @abstractmethod
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values [B, H, S, D] a next block's view starts with (dequantized where quantized)."""

    @abstractmethod
    def _evict(self, state: dict[str, Any], keep: Keep) -> dict[str, Any]:
        """`state` without what no row needs any more (at the format's granularity)."""

    @abstractmethod
    def _crop(self, state: dict[str, Any], columns: int) -> dict[str, Any]:
        """`state` with its last columns dropped, so that `columns` were fed; CacheCropError if not exact."""

    # -- the shared machinery ---------------------------------------------------------------------------------
    def commit(self, staged: Staged, keep: Keep | None = None) -> None:
        state = staged.state if keep is None else self._evict(staged.state, keep)
        self._state = state

    def state(self) -> dict[str, Any]:
        """The state (tensors are not copied: the storage never writes them in place)."""
        return dict(self._state)

    def load_state(self, state: dict[str, Any]) -> None:
        self._state = dict(state)

    @property
    def columns(self) -> int:
        """Columns fed so far (tokens per row, padding included)."""
        return self._state["columns"]

    @property
    def pos(self) -> torch.Tensor:
        """Positions [B, S] of the columns a block's view starts with (before its own)."""
        return self._state["pos"]

    def nbytes(self) -> int:
        """Bytes actually held: packed codes, scales, minimums and dense tails (positions not counted)."""
        return tensor_nbytes(*(t for n, t in self._state.items() if isinstance(t, torch.Tensor) and n != "pos"))

    def crop(self, columns: int) -> None:
        if not 0 <= columns <= self.columns:
            raise CacheError(f"cannot crop to {columns} columns: {self.columns} were fed")
        self._state = self._crop(self._state, columns)

    def select(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` [B'] (reorder, select, repeat)."""
        state = self._select_rows(self._state, index)
        self._state, self.batch = state, index.numel()

    def _select_rows(self, state: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        return {n: t.index_select(0, index) if isinstance(t, torch.Tensor) else t for n, t in state.items()}

    def check_block(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        want = (self.batch, self.heads, k.shape[2] if k.dim() == 4 else -1, self.head_dim)
        for label, t in (("keys", k), ("values", v)):
            if t.dim() != 4 or tuple(t.shape) != want or t.dtype != self.dtype:
                raise CacheError(
                    f"{type(self).__name__}: {label} must be [B, H, T, D] = {want} in {self.dtype}, "
                    f"got {tuple(t.shape)} in {t.dtype}"
                )
        if k.shape[2] == 0 or tuple(pos.shape) != (self.batch, k.shape[2]):
            raise CacheError(
                f"{type(self).__name__}: a block needs >= 1 token and positions [B, T] = "
                f"{(self.batch, k.shape[2])}, got {tuple(pos.shape)}"
            )
