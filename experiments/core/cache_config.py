"""The app's cache presets -> a library cache config: null fields dropped, plugins loaded, and notes on fields
that have no effect (so a sweep over one shared schema never changes a layer silently)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

# No torch at import time: run.py checks the command line with SIZE_FIELDS before torch is imported (usage.py).


def _accepted(key: str, entry: dict) -> set[str]:
    """Parameters an entry's effective type takes: its own type, else its type name, else all of its kind."""
    from hybridcache.cache import available_layers, get_layer_class

    if "type" in entry:
        return get_layer_class(entry["type"]).spec_cls.tunable_names()
    if key in ("attention", "recurrent"):  # what every type of the kind takes (a type taking none, such as
        # compressed_kv, a compressor's buffer, cannot be configured and vetoes nothing)
        names = [get_layer_class(t).spec_cls.tunable_names() for t in available_layers(key)]
        return set.intersection(*[n for n in names if n]) if any(names) else set()
    return get_layer_class(key).spec_cls.tunable_names() if key in available_layers() else set()


def _why_ignored(key: str, entry: dict, name: str) -> str:
    if "type" in entry:
        return f"cache type '{entry['type']}' does not take {name}"
    if key in ("attention", "recurrent"):
        return f"cache.{key}.type is not set (set it to apply {name} to every {key} layer)"
    return f"layers natively '{key}' do not take {name} unless cache.{key}.type is set"


DTYPE_FIELDS = ("state_dtype",)  # names of float dtypes on the command line -> torch dtypes
SIZE_FIELDS = {
    "window": 1,
    "chunk_size": 1,
    "sinks": 1,
    "budget": 1,
    "q_group_size": 1,
    "residual": 0,
    "rollback": 0,
    "max_length": 1,
}  # field -> smallest valid value


def size_field_problem(where: str, key: str, value: Any) -> str | None:
    """Why `value` is not a valid size field `key` (in SIZE_FIELDS) of `cache.<where>`, or None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < SIZE_FIELDS[key]:
        kind = "a positive integer" if SIZE_FIELDS[key] else "an integer >= 0"
        return f"cache.{where} must be {kind}, got {value!r}"
    return None


def _typed(where: str, entry: dict) -> dict:
    """An entry's values as the library takes them (dtype names -> torch dtypes); a bad value, even in a field that
    has no effect on this model, is named: `cache.attention.window=-3` is a mistake whatever the type."""
    import torch

    from hybridcache.cache import CacheConfigError

    out = dict(entry)
    for k, v in entry.items():
        if k in DTYPE_FIELDS and isinstance(v, str):
            dtype = getattr(torch, v.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise CacheConfigError(
                    f"cache.{where}.{k}={v} is not a floating-point dtype (float32, float64, bfloat16, float16)"
                )
            out[k] = dtype
        elif k in SIZE_FIELDS and size_field_problem(f"{where}.{k}", k, v):
            raise CacheConfigError(size_field_problem(f"{where}.{k}", k, v))
    return out


def cache_config_with_notes(cache_cfg: DictConfig | dict) -> tuple[dict[str, Any], bool, list[str]]:
    """The cache-config mapping, whether to preallocate, and notes on fields that have no effect.

    Presets share one schema (configs/cache_schema/base.yaml) so a sweep can override any field of any preset. A null
    value means unset. `plugins` are imported first, so their types are known. A known parameter the entry's
    effective type does not take (chunk_size under type sliding) is dropped with a note; unknown names stay, for
    resolve_plan to reject.
    """
    from hybridcache.cache import available_layers, get_layer_class, load_plugins

    raw = OmegaConf.to_container(cache_cfg, resolve=True) if isinstance(cache_cfg, DictConfig) else dict(cache_cfg)
    preallocate = bool(raw.pop("preallocate", False))
    plugins = raw.pop("plugins", None) or []
    if plugins:
        load_plugins(list(plugins) if isinstance(plugins, (list, tuple)) else plugins)
    known = set().union(*(get_layer_class(t).spec_cls.tunable_names() for t in available_layers()))
    config: dict[str, Any] = {"plugins": list(plugins)} if plugins else {}
    notes: list[str] = []
    for key, entry in raw.items():
        if not isinstance(entry, dict):
            config[key] = entry  # resolve_plan names the problem
            continue
        entry = {k: v for k, v in entry.items() if v is not None}
        if key == "layers":
            entry = {i: _layer_entry(f"layers.{i}", e) for i, e in entry.items()}
        elif key in ("attention", "recurrent") or key in available_layers():
            entry = _typed(key, entry)
            if "type" in entry and entry["type"] not in available_layers():
                config[key] = entry  # resolve_plan names the unknown type and the known ones
                continue
            accepted = _accepted(key, entry)
            for k, v in entry.items():
                if k != "type" and k in known and k not in accepted:
                    notes.append(f"cache.{key}.{k}={v} has no effect: {_why_ignored(key, entry, k)}")
            entry = {k: v for k, v in entry.items() if k == "type" or k in accepted or k not in known}
        if entry:
            config[key] = entry
    return config, preallocate, notes


def _layer_entry(where: str, e: Any) -> Any:
    """One `layers.<i>` entry (or a group's `{member: entry}`) without nulls, typed."""
    if not isinstance(e, dict):
        return e
    e = {k: v for k, v in e.items() if v is not None}
    if e and all(isinstance(v, dict) for v in e.values()):  # a group: {attention: {...}, mamba: {...}}
        return {m: _typed(f"{where}.{m}", {k: v for k, v in sub.items() if v is not None}) for m, sub in e.items()}
    return _typed(where, e)


def cache_config_from_hydra(cache_cfg: DictConfig | dict) -> tuple[dict[str, Any], bool]:
    """The cache-config mapping and whether to preallocate (see `cache_config_with_notes`)."""
    config, preallocate, _ = cache_config_with_notes(cache_cfg)
    return config, preallocate
