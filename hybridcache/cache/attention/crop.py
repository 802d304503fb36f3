"""Cropping an attention cache layer (attention.py's `_prepare_crop` / `_commit_crop`): a crop is exact only if every
row still holds the tokens its pattern would need after it; otherwise a CacheCropError names the row."""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.cache.attention.view import _per_row
from hybridcache.cache.core.errors import CacheCropError


def prepare_crop(layer: Any, n: int, seen: torch.Tensor) -> Any:
    """Validate a crop of an attention layer to n columns: every row must still hold the tokens it would need."""
    rows = _per_row(seen, layer.key_pos)
    kept = (layer.key_pos >= 0) & (layer.key_pos < rows)  # [B, (H,) S]
    have = (kept & layer.spec.visible(rows, layer.key_pos)).sum(-1)  # [B] or [B, H]: per head, the fewest counts
    have = have if have.dim() == 1 else have.min(1).values
    need = layer.spec.needed_tokens(seen)
    if bool((have < need).any()):
        row = int((have < need).nonzero()[0])
        raise CacheCropError(
            f"{layer.name}: cannot crop to {n} tokens exactly: row {row} would need its last {int(need[row])} "
            f"tokens but only {int(have[row])} are still held (the rest were evicted by the "
            f"{layer.type_name} pattern). Take cache.snapshot() before the tokens you may roll back, "
            "and cache.restore() it instead."
        )
    if layer._grouped is not None:
        return layer._grouped.prepare_crop(n)
    return kept, seen


def commit_crop(layer: Any, plan: Any) -> None:
    """Drop what a crop removes (the plan of `prepare_crop`)."""
    if layer._grouped is not None:
        layer._grouped.commit_crop(plan)
        return layer._publish()
    kept, seen = plan
    layer._fetch()
    if layer._window is not None:
        layer._window.crop(seen)
    if layer.static:
        layer.key_pos.masked_fill_(~kept, -1)
    else:
        layer.key_pos = torch.where(kept, layer.key_pos, -1)
        columns = kept.flatten(0, -2).any(0)  # slots some row (and head) still holds
        if not bool(columns.all()):
            layer._take(columns.nonzero().squeeze(1))
    layer._park()
