"""What an attention block attends to (`AttentionView`) and the slot indexing every attention storage shares.

Positions are [B, S] (shared by a row's kv heads) or [B, H, S] (per kv head: patterns that keep different tokens per
head); masks follow: [B, T, S] or [B, H, T, S].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.cache.attention.specs import AttentionSpec
from hybridcache.cache.core.errors import CacheError


@dataclass
class AttentionView:
    """What one block attends to: keys/values [B, H, S, D], their positions ([B, S], or [B, H, S] per kv head),
    the queries' [B, T]."""

    keys: torch.Tensor
    values: torch.Tensor
    query_positions: torch.Tensor  # [B, T], -1 for padding
    key_positions: torch.Tensor  # [B, S] or [B, H, S], -1 for padding or empty slots
    spec: AttentionSpec

    @property
    def mask(self) -> torch.Tensor:
        """Boolean visibility [B, T, S] (or [B, H, T, S] with per-head positions): True where query t may attend to
        key s."""
        if self.key_positions.dim() == 3:
            q, k = self.query_positions[:, None, :, None], self.key_positions[:, :, None, :]
        else:
            q, k = self.query_positions[:, :, None], self.key_positions[:, None, :]
        return (q >= 0) & (k >= 0) & self.spec.visible(q, k)

    def pattern(self) -> tuple[torch.Tensor, torch.Tensor, str, int] | None:
        """(query positions, key positions, pattern name, window or chunk size) for the built-in patterns, which a
        decode kernel evaluates itself (no mask tensor); None for any other spec (use `mask`)."""
        form = self.spec.kernel_pattern()
        if form is None:
            return None
        return self.query_positions, self.key_positions, *form


def _slot_index(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A slot index per row [B, S'] (or per row and head [B, H, S']) broadcast to gather/scatter along dim 2 of a
    [B, H, S', ...] tensor."""
    if index.dim() == 3:
        b, h, n = index.shape
        return index.view(b, h, n, *([1] * (like.dim() - 3))).expand(b, h, n, *like.shape[3:])
    b, n = index.shape
    return index.view(b, 1, n, *([1] * (like.dim() - 3))).expand(b, like.shape[1], n, *like.shape[3:])


def _gather_slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [B, H, S, ...] at slots `index` ([S'] shared by rows, [B, S'] per row or [B, H, S'] per row and head)
    -> [B, H, S', ...]."""
    if index.dim() == 1:
        return t.index_select(2, index)
    return t.gather(2, _slot_index(index, t))


def _per_row(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x [B] shaped to broadcast against per-row positions [B, S] or per-head positions [B, H, S]."""
    return x.view(-1, *([1] * (like.dim() - 1)))


def check_kv(name: str, s: AttentionSpec, batch: int, device: torch.device, k: Any, v: Any) -> int:
    """A block's keys and values [B, H, T, D] as layer `name` holds them (named errors); returns T."""
    for label, t in (("keys", k), ("values", v)):
        if not isinstance(t, torch.Tensor):
            raise CacheError(f"{name}: {label} must be a tensor [B, H, T, D], got {type(t).__name__}")
        if t.dim() != 4:
            raise CacheError(f"{name}: {label} must have 4 dims [B, H, T, D], got shape {tuple(t.shape)}")
        b, h, n, d = t.shape
        if b != batch:
            raise CacheError(f"{name}: {label} have batch size {b}, the cache was built for {batch}")
        if h != s.num_kv_heads:
            raise CacheError(f"{name}: {label} have {h} heads, the layer holds {s.num_kv_heads} kv heads")
        if d != s.head_dim:
            raise CacheError(f"{name}: {label} have head_dim {d}, the layer holds head_dim {s.head_dim}")
        if t.dtype != s.dtype:
            raise CacheError(f"{name}: {label} have dtype {t.dtype}, the layer holds {s.dtype}")
        if t.device != device:
            raise CacheError(f"{name}: {label} are on {t.device}, the layer is on {device}")
    if k.shape != v.shape:
        raise CacheError(f"{name}: keys {tuple(k.shape)} and values {tuple(v.shape)} differ in shape")
    if k.shape[2] == 0:
        raise CacheError(f"{name}: empty block (0 tokens)")
    return k.shape[2]
