"""Cache configs: from a model's native per-layer cache types plus overrides to a resolved `CachePlan`.

A cache config is a mapping; the most specific entry wins:
    attention: / recurrent:   every layer of that kind
    full: / sliding: / ...    every layer whose native type is that name
    layers: {3: ...}          one layer by index
Each entry may set `type` and that type's tunable parameters (window, chunk_size, max_length, state_dtype).
An entry whose `type` is overridden by a more specific one does not pass its parameters on.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from hybridcache.cache.base import LayerSpec
from hybridcache.cache.errors import CacheConfigError, CacheError
from hybridcache.cache.registry import available_layers, get_layer_class

KINDS = ("attention", "recurrent")


@dataclass(frozen=True)
class NativeLayer:
    """What a model declares for one layer: its native cache type and every parameter it knows (shapes,
    dtype, native window/chunk size)."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerPlan:
    index: int
    native_type: str
    type: str
    spec: LayerSpec

    @property
    def kind(self) -> str:
        return get_layer_class(self.type).kind


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class CachePlan:
    """The resolved cache type and spec of every layer."""

    layers: tuple[LayerPlan, ...]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerPlan:
        return self.layers[i]

    def held_nbytes(self, batch: int, tokens: int) -> int:
        return sum(p.spec.held_nbytes(batch, tokens) for p in self.layers)

    def table(self, batch: int = 1, tokens: int = 4096) -> Table:
        t = Table(title=f"cache plan (bytes for batch {batch} after {tokens} tokens)")
        for col in ("layer", "native", "cache type", "parameters", "bytes"):
            t.add_column(col, justify="right" if col in ("layer", "bytes") else "left")
        for p in self.layers:
            params = ", ".join(f"{k}={_fmt(v)}" for k, v in p.spec.params().items() if v is not None)
            t.add_row(str(p.index), p.native_type, p.type, params, format_bytes(p.spec.held_nbytes(batch, tokens)))
        t.add_row("all", "", "", "", format_bytes(self.held_nbytes(batch, tokens)), style="bold")
        return t

    def render(self, batch: int = 1, tokens: int = 4096) -> str:
        return render_table(self.table(batch, tokens))

    def __str__(self) -> str:
        return self.render()

    def to_records(self, batch: int = 1, tokens: int = 4096) -> list[dict[str, Any]]:
        """One plain dict per layer (for logging); every record has the same keys."""
        params = sorted({k for p in self.layers for k in p.spec.params()})
        return [
            {"layer": p.index, "native": p.native_type, "type": p.type,
             **{k: _fmt(p.spec.params().get(k)) for k in params},
             "bytes": p.spec.held_nbytes(batch, tokens)}
            for p in self.layers
        ]


def render_table(table: Table) -> str:
    """A rich table as plain text (for logs and __str__)."""
    out = io.StringIO()
    Console(file=out, width=110).print(table)
    return out.getvalue()


def _fmt(v: Any) -> Any:
    return str(v).replace("torch.", "") if hasattr(v, "is_floating_point") else v


def _as_dict(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise CacheConfigError(f"cache config: '{where}' must be a mapping, got {value!r}")
    return {str(k) if not isinstance(k, int) else k: v for k, v in value.items()}


def _layer_index(key: Any, num_layers: int) -> int:
    try:
        i = int(key)
    except (TypeError, ValueError):
        raise CacheConfigError(f"cache config: layers.{key}: layer keys must be integers") from None
    if not 0 <= i < num_layers:
        raise CacheConfigError(f"cache config: layers.{key}: layer index out of range (the model has {num_layers} layers)")
    return i


def _check_group(where: str, group: dict[str, Any]) -> None:
    """An entry that sets a type may only name that type's tunable parameters."""
    if "type" not in group:
        return
    cls = get_layer_class(group["type"])
    tunables = cls.spec_cls.tunable_names()
    for key in group:
        if key != "type" and key not in tunables:
            raise CacheConfigError(
                f"cache config: {where}.{key}: unknown parameter for cache type '{group['type']}' "
                f"(accepted: {', '.join(sorted(tunables)) or 'none'})"
            )


def resolve_plan(
    native: Sequence[NativeLayer], cache_config: Mapping[str, Any] | None = None, max_length: int | None = None
) -> CachePlan:
    """Resolve a model's native layers and a cache config into a `CachePlan` (clear errors for anything wrong)."""
    config = _as_dict(cache_config, "cache_config")
    allowed = set(KINDS) | {"layers"} | set(available_layers())
    for key in config:
        if key not in allowed:
            raise CacheConfigError(
                f"cache config: unknown key '{key}' (expected 'attention', 'recurrent', 'layers' or a cache type: "
                f"{', '.join(available_layers())})"
            )
    groups = {k: _as_dict(v, k) for k, v in config.items() if k != "layers"}
    per_layer = {_layer_index(k, len(native)): _as_dict(v, f"layers.{k}")
                 for k, v in _as_dict(config.get("layers"), "layers").items()}
    for where, group in [*groups.items(), *((f"layers.{i}", g) for i, g in per_layer.items())]:
        _check_group(where, group)
    return CachePlan(tuple(_resolve_layer(i, nl, groups, per_layer.get(i, {}), max_length) for i, nl in enumerate(native)))


def _resolve_layer(i: int, nl: NativeLayer, groups: dict, own: dict, max_length: int | None) -> LayerPlan:
    native_cls = get_layer_class(nl.type)
    kind = native_cls.kind
    levels = [(kind, groups.get(kind, {})), (nl.type, groups.get(nl.type, {})), (f"layers.{i}", own)]
    type_level, final = -1, nl.type
    for level, (_, group) in enumerate(levels):
        if "type" in group:
            type_level, final = level, group["type"]
    cls = get_layer_class(final)
    if cls.kind != kind:
        raise CacheConfigError(
            f"cache config: layer {i} is a {kind} layer (native '{nl.type}') and cannot use the {cls.kind} cache "
            f"type '{final}'; {kind} types: {', '.join(available_layers(kind))}"
        )
    spec_fields, tunables = cls.spec_cls.field_names(), cls.spec_cls.tunable_names()
    params = {k: v for k, v in nl.params.items() if k in spec_fields}
    if max_length is not None and "max_length" in spec_fields:
        params["max_length"] = max_length
    for level, (where, group) in enumerate(levels):
        if "type" in group and level < type_level:
            continue  # its parameters belong to a type that a more specific entry replaced
        for key, value in group.items():
            if key == "type":
                continue
            if key not in tunables:
                raise CacheConfigError(
                    f"cache config: {where}.{key}: layer {i} resolves to cache type '{final}', which does not take "
                    f"'{key}' (accepted: {', '.join(sorted(tunables)) or 'none'}); set `type` in the same entry"
                )
            params[key] = value
    missing = cls.spec_cls.required_names() - set(params)
    if missing:
        what = "parameter" if missing <= tunables else "model shapes"
        raise CacheConfigError(
            f"cache config: layer {i} (native '{nl.type}') cannot use cache type '{final}': missing {what} "
            f"{', '.join(sorted(missing))}"
        )
    try:
        spec = cls.spec_cls(**params)
    except CacheError as e:
        raise CacheConfigError(f"cache config: layer {i} ('{final}'): {e}") from None
    return LayerPlan(i, nl.type, final, spec)
