"""`Cache`: the per-layer cache objects of one model and batch, with atomic whole-cache operations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
from rich.table import Table

from hybridcache.cache.base import CacheLayer, LayerSnapshot, check_valid_mask
from hybridcache.cache.errors import CacheError
from hybridcache.cache.plan import CachePlan, NativeLayer, format_bytes, render_table, resolve_plan
from hybridcache.cache.registry import get_layer_class


@dataclass(frozen=True)
class CacheSnapshot:
    """Deep copies of every layer's state; `Cache.restore` puts them back bit-exactly."""

    layers: tuple[LayerSnapshot, ...]


class Cache:
    """A list of cache layers (one per model layer) that share a batch and advance together.

    Whole-cache operations (reorder, select, repeat, crop, restore) validate every layer before changing any,
    so a call that raises leaves the cache unchanged.
    """

    def __init__(self, layers: Sequence[CacheLayer], plan: CachePlan | None = None) -> None:
        layers = list(layers)
        if not layers:
            raise CacheError("a Cache needs at least one cache layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, CacheLayer):
                raise CacheError(f"Cache entry {i} is a {type(layer).__name__}, not a CacheLayer")
        if len({layer.batch_size for layer in layers}) != 1:
            raise CacheError(f"cache layers disagree on the batch size: {[layer.batch_size for layer in layers]}")
        self.layers = layers
        self.plan = plan

    @classmethod
    def from_plan(cls, plan: CachePlan, batch_size: int, device: torch.device | str | None = None) -> "Cache":
        layers = [get_layer_class(p.type)(p.spec, batch_size, device) for p in plan.layers]
        return cls(layers, plan)

    @classmethod
    def build(
        cls,
        native: Sequence[NativeLayer],
        batch_size: int,
        cache_config: Mapping[str, Any] | None = None,
        max_length: int | None = None,
        device: torch.device | str | None = None,
    ) -> "Cache":
        """Resolve `cache_config` against the model's native layers and allocate the cache."""
        return cls.from_plan(resolve_plan(native, cache_config, max_length), batch_size, device)

    # -- sequence ----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> CacheLayer:
        return self.layers[i]

    def __iter__(self) -> Iterator[CacheLayer]:
        return iter(self.layers)

    def __repr__(self) -> str:
        types = ", ".join(layer.type_name for layer in self.layers)
        return f"Cache([{types}]; batch={self.batch_size}, columns={self.columns})"

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    @property
    def seen(self) -> torch.Tensor:
        """Real tokens seen per row [B] (left padding excluded)."""
        return self.layers[0].seen.clone()

    @property
    def columns(self) -> int:
        """Length of the sequence fed so far, padding included."""
        return self.layers[0].columns

    def positions(self, valid: torch.Tensor | None = None, num_tokens: int | None = None) -> torch.Tensor:
        """Positions [B, T] the next block's tokens will get (-1 for padding), without changing the cache."""
        layer = self.layers[0]
        if valid is None:
            if num_tokens is None or num_tokens <= 0:
                raise CacheError("positions() needs a real-token mask [B, T] or a positive num_tokens")
            tokens = num_tokens
        else:
            tokens = valid.shape[-1] if isinstance(valid, torch.Tensor) and valid.dim() == 2 else -1
        valid = check_valid_mask(valid, layer.batch_size, tokens, layer.seen, "Cache.positions")
        pos = layer.seen[:, None] + valid.long().cumsum(1) - 1
        return torch.where(valid, pos, -1)

    # -- atomic whole-cache operations -------------------------------------------------------------------------
    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def reorder(self, index: Any) -> None:
        """Row i becomes old row index[i] in every layer (beam search)."""
        plans = [layer._prepare_index(index, same_size=True) for layer in self.layers]
        for layer, plan in zip(self.layers, plans):
            layer._commit_index(plan)

    def select(self, index: Any) -> None:
        """Keep rows `index` (the batch size may change)."""
        plans = [layer._prepare_index(index, same_size=False) for layer in self.layers]
        for layer, plan in zip(self.layers, plans):
            layer._commit_index(plan)

    def repeat(self, n: int) -> None:
        """Repeat each row n times ([a, b] -> [a, a, b, b]), e.g. for several samples per prompt."""
        plans = [layer._prepare_repeat(n) for layer in self.layers]
        for layer, plan in zip(self.layers, plans):
            layer._commit_index(plan)

    def crop(self, n: int) -> None:
        """Truncate every layer to the first n columns; raises (changing nothing) if a layer cannot."""
        plans = [layer._prepare_crop(n) for layer in self.layers]
        for layer, plan in zip(self.layers, plans):
            layer._commit_crop(plan)

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(tuple(layer.snapshot() for layer in self.layers))

    def restore(self, snap: CacheSnapshot) -> None:
        if not isinstance(snap, CacheSnapshot) or len(snap.layers) != len(self.layers):
            raise CacheError("restore needs a CacheSnapshot taken from a cache with the same layers")
        plans = [layer._prepare_restore(s) for layer, s in zip(self.layers, snap.layers)]
        for layer, plan in zip(self.layers, plans):
            layer._commit_restore(plan)

    # -- memory ------------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of keys, values and states actually held."""
        return sum(layer.nbytes() for layer in self.layers)

    def memory_report(self) -> list[dict[str, Any]]:
        """Per cache type: layers, bytes held, theoretical minimum for what the rows have seen, and the ratio."""
        rows: dict[str, dict[str, Any]] = {}
        for layer in self.layers:
            key = layer.type_name + (" (preallocated)" if getattr(layer, "static", False) else "")
            row = rows.setdefault(key, {"type": key, "layers": 0, "held": 0, "minimum": 0})
            row["layers"] += 1
            row["held"] += layer.nbytes()
            row["minimum"] += layer.min_nbytes()
        for row in rows.values():
            row["ratio"] = row["held"] / row["minimum"] if row["minimum"] else (1.0 if not row["held"] else float("inf"))
        return list(rows.values())

    def memory_table(self) -> Table:
        t = Table(title=f"cache memory (batch {self.batch_size}, {self.columns} columns)")
        for col in ("type", "layers", "held", "minimum", "held / minimum"):
            t.add_column(col, justify="left" if col == "type" else "right")
        for r in self.memory_report():
            t.add_row(r["type"], str(r["layers"]), format_bytes(r["held"]), format_bytes(r["minimum"]), f"{r['ratio']:.2f}")
        return t

    def render_memory(self) -> str:
        return render_table(self.memory_table())
