"""`compressed_kv`: the cache of a compressor that pools every `compress_rate` consecutive tokens into one entry (the
long-range branch of DeepSeek-V4's compressed attention; its indexer keeps one of these too).

The windows are aligned to the sequence's columns, left padding included (as DeepSeek-V4 computes them), so every row
holds the same number of entries. The layer holds:
- `entries` [B, E, D]: the entries emitted so far, E = columns // compress_rate (what attention reads);
- `buffer_kv`, `buffer_gate` [B, b, W]: the projected sources (values and gate logits) of the window still open,
  b = columns % compress_rate;
- with `overlap` (CSA's two series per token, W = 2 D; entry w pools the first series of window w-1 with the second
  of window w): `overlap_kv`, `overlap_gate` [B, compress_rate, D], the first series of the last closed window, its
  gate with the mixer's position bias added (in `overlap_gate_dtype`: the dtype that bias gives it, float32 in
  DeepSeek-V4 checkpoints).

The mixer pools (gated softmax, norm, rotary); the layer is storage. In a block it hands the mixer the sources of the
windows the block closes (`ready`) and the last closed window (`previous_window`), and takes back the block's sources
with the new entries (and the last closed window) in one `update`, staged until the block commits.

Crop: the sources of closed windows are not kept, so `crop(n)` is exact back to the start of the open window
(n >= E * compress_rate: the open window loses its tail) and a `CacheCropError` before that. Reorder, select and
repeat move rows; snapshot / restore and saved files hold every tensor above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.cache.core.base import CacheLayer, LayerSpec, check_float_dtype, check_positive_int, dtype_nbytes
from hybridcache.cache.core.errors import CacheCropError, CacheError
from hybridcache.cache.core.registry import register_cache_layer


@dataclass(frozen=True, kw_only=True)
class CompressedKVSpec(LayerSpec):
    """A compressor's cache: one entry of `entry_dim` per `compress_rate` columns (`dtype`: entries and sources)."""

    compress_rate: int
    entry_dim: int
    overlap: bool = False
    overlap_gate_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_positive_int(owner, "compress_rate", self.compress_rate)
        check_positive_int(owner, "entry_dim", self.entry_dim)
        if not isinstance(self.overlap, bool):
            raise CacheError(f"{owner}: overlap must be true or false, got {self.overlap!r}")
        check_float_dtype(owner, "overlap_gate_dtype", self.overlap_gate_dtype)

    @property
    def source_dim(self) -> int:
        """W: the projected width per source token (two series of `entry_dim` with overlap)."""
        return self.entry_dim * (2 if self.overlap else 1)

    def min_nbytes(self, batch: int, tokens: int) -> int:
        """Entries, the open window's sources (values and gates), and with overlap the last closed window's first
        series (held from the first block on)."""
        item = dtype_nbytes(self.dtype)
        entries = (tokens // self.compress_rate) * self.entry_dim * item
        buffer = (tokens % self.compress_rate) * self.source_dim * 2 * item
        gate_item = dtype_nbytes(self.overlap_gate_dtype)
        last = self.compress_rate * self.entry_dim * (item + gate_item) if self.overlap else 0
        return batch * (entries + buffer + last)


@dataclass
class CompressedWrite:
    """What `update` stages for the open block: the layer's tensors after it."""

    entries: torch.Tensor  # [B, E + n, D]
    buffer_kv: torch.Tensor  # [B, b', W]
    buffer_gate: torch.Tensor  # [B, b', W]
    last_window: tuple[torch.Tensor, torch.Tensor] | None  # [B, r, D] each, or None: unchanged


@register_cache_layer("compressed_kv")
class CompressedKVLayer(CacheLayer):
    """Entries of a compressor plus the sources of its open window (see the module docstring)."""

    kind = "recurrent"  # not attended through `update(k, v)`: a running state the mixer reads and hands back
    spec_cls = CompressedKVSpec
    spec: CompressedKVSpec
    example_native = {"compress_rate": 3, "entry_dim": 4, "overlap": True}

    @property
    def _batch_tensors(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("entries", "buffer_kv", "buffer_gate") + (("overlap_kv", "overlap_gate") if self.spec.overlap else ())

    def _allocate(self, batch_size: int) -> None:
        s, dev = self.spec, self.device
        self.entries = torch.zeros(batch_size, 0, s.entry_dim, dtype=s.dtype, device=dev)  # [B, E, D]
        self.buffer_kv = torch.zeros(batch_size, 0, s.source_dim, dtype=s.dtype, device=dev)  # [B, b, W]
        self.buffer_gate = torch.zeros(batch_size, 0, s.source_dim, dtype=s.dtype, device=dev)
        if s.overlap:  # [B, r, D]: meaningful once a window has closed (entry_count > 0)
            self.overlap_kv = torch.zeros(batch_size, s.compress_rate, s.entry_dim, dtype=s.dtype, device=dev)
            self.overlap_gate = torch.zeros(
                batch_size, s.compress_rate, s.entry_dim, dtype=s.overlap_gate_dtype, device=dev
            )

    # -- reading --------------------------------------------------------------------------------------------------
    @property
    def entry_count(self) -> int:
        """E: entries emitted so far (closed windows)."""
        return int(self.entries.shape[1])

    def min_nbytes(self) -> int:
        """Column-aligned windows: every row holds what `columns` tokens give (padding included)."""
        return self.spec.min_nbytes(self.batch_size, self.columns)

    def _check_sources(self, kv: Any, gate: Any) -> None:
        s = self.spec
        for what, t in (("kv", kv), ("gate", gate)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CacheError(f"{self.name}: sources '{what}' must be [B, T, {s.source_dim}], got {got}")
            if t.shape[0] != self.batch_size or t.shape[2] != s.source_dim:
                raise CacheError(
                    f"{self.name}: sources '{what}' must be [{self.batch_size}, T, {s.source_dim}], got "
                    f"{tuple(t.shape)}"
                )
            if t.dtype != s.dtype or t.device != self.device:
                raise CacheError(
                    f"{self.name}: sources '{what}' are {t.dtype} on {t.device}, the layer holds {s.dtype} on "
                    f"{self.device}"
                )
        if kv.shape[1] != gate.shape[1]:
            raise CacheError(f"{self.name}: {kv.shape[1]} kv sources but {gate.shape[1]} gate sources")

    def ready(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The sources of the windows a block of sources `kv`, `gate` [B, T, W] closes ([B, n * r, W] each: the
        open window's held sources first) and the column where the first of them starts (E * r). Reads only."""
        self._check_sources(kv, gate)
        r = self.spec.compress_rate
        kv, gate = torch.cat([self.buffer_kv, kv], dim=1), torch.cat([self.buffer_gate, gate], dim=1)
        usable = (kv.shape[1] // r) * r
        return kv[:, :usable], gate[:, :usable], self.entry_count * r

    def previous_window(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With overlap: the first series (kv, gate [B, r, D]) of the last closed window; None before the first."""
        if not self.spec.overlap:
            raise CacheError(f"{self.name}: a compressor without overlap keeps no previous window")
        if self.entry_count == 0:
            return None
        return self.overlap_kv, self.overlap_gate

    # -- feeding a block ------------------------------------------------------------------------------------------
    def update(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        entries: torch.Tensor,
        last_window: tuple[torch.Tensor, torch.Tensor] | None = None,
        valid: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Feed a block: its sources `kv`, `gate` [B, T, W], the entries pooled from the n windows it closes
        (`entries` [B, n, D], n = (b + T) // r) and, with overlap when n > 0, the first series of the last of them
        (`last_window`: kv [B, r, D] in `dtype`, gate [B, r, D] in `overlap_gate_dtype`). Returns every entry
        [B, E + n, D]. A standalone layer takes the block's mask [B, T] or length as `valid`."""
        s = self.spec
        self._check_sources(kv, gate)
        n = (self.buffer_kv.shape[1] + kv.shape[1]) // s.compress_rate
        want = (self.batch_size, n, s.entry_dim)
        if not isinstance(entries, torch.Tensor) or tuple(entries.shape) != want:
            got = tuple(entries.shape) if isinstance(entries, torch.Tensor) else type(entries).__name__
            raise CacheError(f"{self.name}: this block closes {n} window(s), so entries must be {want}, got {got}")
        if entries.dtype != s.dtype or entries.device != self.device:
            raise CacheError(f"{self.name}: entries are {entries.dtype} on {entries.device}, expected {s.dtype}")
        if s.overlap and n > 0:
            self._check_last_window(last_window)
        elif last_window is not None:
            why = "keeps no previous window" if not s.overlap else "closes no window in this block"
            raise CacheError(f"{self.name}: last_window given, but the layer {why}")
        _, opened = self._open(valid, kv.shape[1])
        r = s.compress_rate
        all_kv, all_gate = torch.cat([self.buffer_kv, kv], dim=1), torch.cat([self.buffer_gate, gate], dim=1)
        usable = n * r
        self._staged = CompressedWrite(
            torch.cat([self.entries, entries], dim=1),
            all_kv[:, usable:].clone(),  # (a clone: not the whole block's storage)
            all_gate[:, usable:].clone(),
            None if last_window is None else (last_window[0].clone(), last_window[1].clone()),
        )
        out = self._staged.entries
        self._close(opened, failed=False)
        return out

    def _check_last_window(self, last_window: Any) -> None:
        s = self.spec
        want = (self.batch_size, s.compress_rate, s.entry_dim)
        if not (isinstance(last_window, tuple) and len(last_window) == 2):
            raise CacheError(f"{self.name}: this block closes a window: last_window must be (kv, gate), each {want}")
        for what, t, dtype in (("kv", last_window[0], s.dtype), ("gate", last_window[1], s.overlap_gate_dtype)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != dtype or t.device != self.device:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise CacheError(f"{self.name}: last_window {what} must be {want} {dtype}, got {got}")

    def _commit_staged(self, staged: CompressedWrite) -> None:
        self.entries, self.buffer_kv, self.buffer_gate = staged.entries, staged.buffer_kv, staged.buffer_gate
        if staged.last_window is not None:
            self.overlap_kv, self.overlap_gate = staged.last_window

    # -- crop / restore -------------------------------------------------------------------------------------------
    def _prepare_crop(self, n: int, seen: torch.Tensor) -> int:
        start = self.entry_count * self.spec.compress_rate  # the open window's first column
        if n < start:
            raise CacheCropError(
                f"{self.name}: it keeps {self.entry_count} pooled entries and only the sources of the open window "
                f"(columns {start}..{self.columns - 1}), so crop({n}) cannot rebuild the entries of earlier windows; "
                f"crop back to column {start} at most, or take cache.snapshot() where you may return to"
            )
        return n - start

    def _commit_crop(self, keep: int) -> None:
        self.buffer_kv = self.buffer_kv[:, :keep].clone()
        self.buffer_gate = self.buffer_gate[:, :keep].clone()

    def _prepare_restore(self, snap: Any):
        snap = super()._prepare_restore(snap)
        t, r = snap.tensors, self.spec.compress_rate
        entries, buffered = t["entries"].shape[1], t["buffer_kv"].shape[1]
        if t["buffer_gate"].shape != t["buffer_kv"].shape or buffered >= r or entries * r + buffered != snap.columns:
            raise CacheError(
                f"{self.name}: the snapshot holds {entries} entries and {buffered} open-window sources, which do not "
                f"make {snap.columns} columns at compress_rate {r} (E * r + b with b < r)"
            )
        return snap
