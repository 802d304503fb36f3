"""Cache configs: from a model's native per-layer cache types plus overrides to a resolved `CachePlan`.

A model declares, per decoder layer, one `NativeLayer` or a `NativeGroup` of named members (FalconH1 runs Mamba2
and attention side by side in one layer). A cache config is a mapping; the most specific entry wins:
    attention: / recurrent:   every cache layer of that kind
    full: / sliding: / ...    every cache layer whose native type is that name
    layers: {3: ...}  one decoder layer by index; inside a group, a member: {3: {attention: ...}} or "3.attention"
Each entry may set `type` and that type's tunable parameters (window, chunk_size, max_length, state_dtype, storage).
An entry whose `type` is overridden by a more specific one does not pass its parameters on. A kind-wide entry without
`type` applies each parameter to the layers whose type takes it (`recurrent: {state_dtype: float64}` skips `conv`).
`plugins: [module, ...]` imports modules that register more cache types before anything is resolved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridcache.cache.core.base import LayerSpec
from hybridcache.cache.core.errors import CacheConfigError, CacheError
from hybridcache.cache.core.registry import available_layers, get_layer_class, load_plugins
from hybridcache.cache.storage.codecs import get_codec

KINDS = ("attention", "recurrent")


@dataclass(frozen=True)
class NativeLayer:
    """What a model declares for one cache layer: its native cache type and every parameter it knows (shapes,
    dtype, native window/chunk size)."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NativeGroup:
    """Several cache layers of one decoder layer, by member name (e.g. {"mamba": ..., "attention": ...})."""

    members: Mapping[str, NativeLayer]

    def __post_init__(self) -> None:
        if not self.members:
            raise CacheConfigError("a NativeGroup needs at least one member")
        for name, member in self.members.items():
            if not isinstance(name, str) or not name.isidentifier() or name == "type":
                raise CacheConfigError(f"group member names must be identifiers other than 'type', got {name!r}")
            if not isinstance(member, NativeLayer):
                raise CacheConfigError(f"group member '{name}' must be a NativeLayer, got {type(member).__name__}")


Native = NativeLayer | NativeGroup


@dataclass(frozen=True)
class LayerPlan:
    """The resolved cache layer of decoder layer `index` (and group `member`, if any)."""

    index: int
    native_type: str
    type: str
    spec: LayerSpec
    member: str | None = None

    @property
    def kind(self) -> str:
        return get_layer_class(self.type).kind

    @property
    def address(self) -> str:
        """Where a cache config reaches this layer under `layers:` ("3" or "3.attention")."""
        return str(self.index) if self.member is None else f"{self.index}.{self.member}"

    @property
    def exact(self) -> bool:
        """Whether cached generation with this layer equals the full recompute with its pattern."""
        storage = getattr(self.spec, "storage", None)
        return (
            get_layer_class(self.type).exact
            and (storage is None or get_codec(storage).exact)
            and getattr(self.spec, "exact_storage", True)
        )  # recurrent: the state codec


@dataclass(frozen=True)
class CachePlan:
    """The resolved cache type and spec of every cache layer, in decoder-layer order."""

    layers: tuple[LayerPlan, ...]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerPlan:
        return self.layers[i]

    @property
    def structure(self) -> list[tuple[str, ...] | None]:
        """Per decoder layer: None for a single cache layer, else the member names of its group."""
        out: list[tuple[str, ...] | None] = []
        for p in self.layers:
            if p.index == len(out):
                out.append(None if p.member is None else (p.member,))
            else:
                out[p.index] = (*out[p.index], p.member)
        return out

    @property
    def exact(self) -> bool:
        return all(p.exact for p in self.layers)

    def held_nbytes(self, batch: int, tokens: int) -> int:
        return sum(p.spec.held_nbytes(batch, tokens) for p in self.layers)

    def changed(self, other: CachePlan) -> list[str]:
        """Addresses whose type or parameters differ from `other` (e.g. the native plan)."""
        return [p.address for p, q in zip(self.layers, other.layers) if (p.type, p.spec) != (q.type, q.spec)]

    def to_records(self, batch: int = 1, tokens: int = 4096) -> list[dict[str, Any]]:
        """One plain dict per cache layer (for logging and tables); every record has the same keys."""
        params = sorted({k for p in self.layers for k in p.spec.params()})
        return [
            {
                "layer": p.address,
                "native": p.native_type,
                "type": p.type,
                **{k: fmt_value(p.spec.params().get(k)) for k in params},
                "exact": p.exact,
                "bytes": p.spec.held_nbytes(batch, tokens),
            }
            for p in self.layers
        ]


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def fmt_value(v: Any) -> Any:
    return str(v).replace("torch.", "") if hasattr(v, "is_floating_point") else v


def _as_dict(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise CacheConfigError(f"cache config: '{where}' must be a mapping, got {value!r}")
    return {str(k) if not isinstance(k, int) else k: v for k, v in value.items()}


def _per_layer_entries(native: Sequence[Native], config: Mapping[str, Any]) -> dict[tuple[int, str | None], dict]:
    """`layers:` entries by (decoder layer, member): keys "3", 3 or "3.attention"; a group's entry maps members."""
    out: dict[tuple[int, str | None], dict] = {}
    for key, entry in _as_dict(config.get("layers"), "layers").items():
        index_text, _, member = str(key).partition(".")
        try:
            i = int(index_text)
        except ValueError:
            raise CacheConfigError(
                f"cache config: layers.{key}: layer keys are indices like 3 or 3.attention"
            ) from None
        if not 0 <= i < len(native):
            raise CacheConfigError(
                f"cache config: layers.{key}: layer index out of range (the model has {len(native)} layers)"
            )
        entry = _as_dict(entry, f"layers.{key}")
        nl = native[i]
        if isinstance(nl, NativeLayer):
            if member:
                raise CacheConfigError(f"cache config: layers.{key}: layer {i} has a single cache layer, not a group")
            out[i, None] = entry
            continue
        members = list(nl.members)
        entries = {member: entry} if member else entry  # layers.3: {attention: {...}, mamba: {...}}
        for m, e in entries.items():
            e = _as_dict(e, f"layers.{i}.{m}") if m in nl.members else e
            if m not in nl.members:
                raise CacheConfigError(
                    f"cache config: layers.{i}.{m}: layer {i} is a group of {', '.join(members)}; "
                    f"address a member, e.g. layers.{i}.{members[0]}"
                )
            out[i, m] = e
    return out


#: Parameters renamed (old -> new) on 2026-11-29, each refused by its old name with the new one: a press's eviction
#: schedule was `mode` ("mode" is only the logger's), a state codec's error-feedback codec `residual_codec` ("residual"
#: is the residual window and the residual stream), a recurrent layer's `checkpoints` ("checkpoint" is a model's).
RENAMED_PARAMETERS = {"mode": "schedule", "residual_codec": "error_codec", "checkpoints": "rollback"}


def _refuse_renamed(where: str, key: str, accepted: set[str]) -> None:
    new = RENAMED_PARAMETERS.get(key)
    if new is not None and key not in accepted and new in accepted:
        raise CacheConfigError(f"cache config: {where}.{key} was renamed to '{new}' ({where}.{new})")


def _check_group(where: str, group: dict[str, Any]) -> None:
    """An entry that sets a type may only name that type's tunable parameters; a kind-wide entry without a type
    (`recurrent: {state_dtype: ...}`) may name any parameter that some type of that kind takes."""
    if "type" not in group:
        if where in KINDS:
            known = set().union(*(get_layer_class(t).spec_cls.tunable_names() for t in available_layers(where)))
            for key in group:
                _refuse_renamed(where, key, known)
                if key not in known:
                    raise CacheConfigError(
                        f"cache config: {where}.{key}: no {where} cache type takes '{key}' "
                        f"(accepted: {', '.join(sorted(known))})"
                    )
        return
    cls = get_layer_class(group["type"])
    tunables = cls.spec_cls.tunable_names()
    for key in group:
        _refuse_renamed(where, key, tunables)
        if key != "type" and key not in tunables:
            raise CacheConfigError(
                f"cache config: {where}.{key}: unknown parameter for cache type '{group['type']}' "
                f"(accepted: {', '.join(sorted(tunables)) or 'none'})"
            )


def flatten_native(native: Sequence[Native]) -> list[tuple[int, str | None, NativeLayer]]:
    """(decoder layer, member, native layer) for every cache layer, in order."""
    if not native:
        raise CacheConfigError("a model needs at least one cache layer")
    flat = []
    for i, nl in enumerate(native):
        if isinstance(nl, NativeGroup):
            flat.extend((i, m, member) for m, member in nl.members.items())
        elif isinstance(nl, NativeLayer):
            flat.append((i, None, nl))
        else:
            raise CacheConfigError(f"native layer {i} must be a NativeLayer or NativeGroup, got {type(nl).__name__}")
    return flat


def resolve_plan(
    native: Sequence[Native], cache_config: Mapping[str, Any] | None = None, max_length: int | None = None
) -> CachePlan:
    """Resolve a model's native layers and a cache config into a `CachePlan` (clear errors for anything wrong)."""
    config = _as_dict(cache_config, "cache_config")
    if "plugins" in config:
        plugins = config.pop("plugins") or []
        if not isinstance(plugins, (list, tuple)):
            raise CacheConfigError(f"cache config: plugins must be a list of module names, got {plugins!r}")
        load_plugins(plugins)
    allowed = set(KINDS) | {"layers"} | set(available_layers())
    for key in config:
        if key not in allowed:
            raise CacheConfigError(
                f"cache config: unknown key '{key}' (expected 'attention', 'recurrent', 'layers', 'plugins' or a "
                f"cache type: {', '.join(available_layers())})"
            )
    groups = {k: _as_dict(v, k) for k, v in config.items() if k != "layers"}
    per_layer = _per_layer_entries(native, config)
    for where, group in [*groups.items(), *((f"layers.{_addr(i, m)}", g) for (i, m), g in per_layer.items())]:
        _check_group(where, group)
    plan = CachePlan(
        tuple(
            _resolve_layer(i, m, nl, groups, per_layer.get((i, m), {}), max_length, len(native))
            for i, m, nl in flatten_native(native)
        )
    )
    for kind in KINDS:  # a kind-wide parameter that none of the model's layers of that kind takes is a mistake
        group = groups.get(kind, {})
        layers = [p for p in plan.layers if p.kind == kind]
        if "type" in group or not layers:  # (a model without layers of that kind: nothing to apply, as for sweeps)
            continue
        for key in group:
            if not any(key in get_layer_class(p.type).spec_cls.tunable_names() for p in layers):
                found = sorted({p.type for p in layers})
                raise CacheConfigError(
                    f"cache config: {kind}.{key}: no {kind} layer of this model takes '{key}' (their types: "
                    f"{', '.join(found) or 'none'}); set `type` in the same entry"
                )
    return plan


def _addr(i: int, member: str | None) -> str:
    return str(i) if member is None else f"{i}.{member}"


def _resolve_layer(
    i: int, member: str | None, nl: NativeLayer, groups: dict, own: dict, max_length: int | None, depth: int
) -> LayerPlan:
    native_cls = get_layer_class(nl.type)
    kind, where_i = native_cls.kind, _addr(i, member)
    levels = [(kind, groups.get(kind, {})), (nl.type, groups.get(nl.type, {})), (f"layers.{where_i}", own)]
    type_level, final = -1, nl.type
    for level, (_, group) in enumerate(levels):
        if "type" in group:
            type_level, final = level, group["type"]
    cls = get_layer_class(final)
    if cls.kind != kind:
        raise CacheConfigError(
            f"cache config: layer {where_i} is a {kind} layer (native '{nl.type}') and cannot use the {cls.kind} "
            f"cache type '{final}'; {kind} types: {', '.join(available_layers(kind))}"
        )
    spec_fields, tunables = cls.spec_cls.field_names(), cls.spec_cls.tunable_names()
    params = {k: v for k, v in nl.params.items() if k in spec_fields}
    if max_length is not None and "max_length" in spec_fields:
        params["max_length"] = max_length
    if "layer_index" in spec_fields:  # a spec that depends on its depth in the stack (PyramidKV's budgets)
        params.update(layer_index=i, num_layers=depth)
    for level, (where, group) in enumerate(levels):
        if "type" in group and level < type_level:
            continue  # its parameters belong to a type that a more specific entry replaced
        for key, value in group.items():
            if key == "type":
                continue
            if key not in tunables:
                if level == 0 and "type" not in group:
                    continue  # a kind-wide parameter applies to the layers whose type takes it
                raise CacheConfigError(
                    f"cache config: {where}.{key}: layer {where_i} resolves to cache type '{final}', which does not "
                    f"take '{key}' (accepted: {', '.join(sorted(tunables)) or 'none'}); set `type` in the same entry"
                )
            params[key] = value
    missing = cls.spec_cls.required_names() - set(params)
    if missing:
        what = "parameter" if missing <= tunables else "model shapes"
        raise CacheConfigError(
            f"cache config: layer {where_i} (native '{nl.type}') cannot use cache type '{final}': missing {what} "
            f"{', '.join(sorted(missing))}"
        )
    try:
        spec = cls.spec_cls(**params)
    except CacheError as e:
        raise CacheConfigError(f"cache config: layer {where_i} ('{final}'): {e}") from None
    except TypeError as e:
        raise CacheConfigError(f"cache config: layer {where_i} ('{final}'): bad parameters ({e})") from None
    return LayerPlan(i, nl.type, final, spec, member)
