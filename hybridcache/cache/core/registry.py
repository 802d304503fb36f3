"""The registry of cache layer types: `@register_cache_layer("name")` adds one, `available_layers()` lists them.

A new type is one module: a `CacheLayer` subclass with the decorator. Configs reach it by name once its module is
imported, either by `load_plugins(["mypkg.sink"])` (the app does this for `cache.plugins`) or by an installed
package that declares the module under the entry-point group `hybridcache.cache_layers`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import TypeVar

from hybridcache.cache.core.base import CacheLayer, LayerSpec
from hybridcache.cache.core.errors import CacheConfigError

ENTRY_POINT_GROUP = "hybridcache.cache_layers"
RESERVED = ("attention", "recurrent", "layers", "type", "plugins")

_REGISTRY: dict[str, type[CacheLayer]] = {}
_entry_points_loaded = False
L = TypeVar("L", bound=type[CacheLayer])


def register_cache_layer(name: str, *, replace: bool = False) -> Callable[[L], L]:
    """Class decorator: register a `CacheLayer` subclass under `name` so cache configs can ask for it.

    A name that is taken is an error, and so is registering one class under a second name; `replace=True`
    explicitly swaps the class behind an existing name (e.g. when a notebook re-runs a cell).
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise CacheConfigError(f"cache type names must be identifiers, got {name!r}")
    if name in RESERVED:
        raise CacheConfigError(f"'{name}' is reserved in cache configs and cannot name a cache type")

    def decorate(cls: L) -> L:
        if not (isinstance(cls, type) and issubclass(cls, CacheLayer)):
            raise CacheConfigError(f"@register_cache_layer('{name}') needs a CacheLayer subclass, got {cls!r}")
        if getattr(cls, "kind", None) not in ("attention", "recurrent"):
            raise CacheConfigError(f"{cls.__name__}.kind must be 'attention' or 'recurrent'")
        if not (isinstance(getattr(cls, "spec_cls", None), type) and issubclass(cls.spec_cls, LayerSpec)):
            raise CacheConfigError(f"{cls.__name__}.spec_cls must be a LayerSpec subclass")
        own = cls.__dict__.get("type_name")
        if own is not None and own != name:
            raise CacheConfigError(f"{cls.__name__} is already registered as '{own}'; it cannot also be '{name}'")
        taken = _REGISTRY.get(name)
        if taken is not None and taken is not cls and not replace:
            raise CacheConfigError(
                f"cache type '{name}' is already registered ({taken.__module__}.{taken.__name__}); pick another "
                "name, or pass replace=True to swap it on purpose"
            )
        cls.type_name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def load_plugins(modules: Iterable[str]) -> list[str]:
    """Import modules that register cache types (e.g. `["mypkg.sink"]`); returns the names they added."""
    if isinstance(modules, str):
        modules = [modules]
    before = set(_REGISTRY)
    for module in modules:
        if not isinstance(module, str) or not module:
            raise CacheConfigError(f"cache plugins are module names like 'mypkg.sink', got {module!r}")
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise CacheConfigError(f"cache plugin '{module}' could not be imported: {e}") from e
    return sorted(set(_REGISTRY) - before)


def _load_entry_points() -> None:
    """Import the modules that installed packages declare under `hybridcache.cache_layers` (once). The same group
    carries plugin model families (models/core/registry.py loads it through here): importing a module registers whatever
    cache types and families it defines."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin names itself instead of breaking every config
            raise CacheConfigError(f"plugin entry point '{ep.name}' ({ep.value}) failed to load: {e}") from e


def available_layers(kind: str | None = None) -> list[str]:
    """Names of the registered cache layer types, optionally only those of one kind."""
    _load_entry_points()
    return sorted(n for n, c in _REGISTRY.items() if kind is None or c.kind == kind)


def get_layer_class(name: str) -> type[CacheLayer]:
    if isinstance(name, str) and name in _REGISTRY:
        return _REGISTRY[name]
    _load_entry_points()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise CacheConfigError(
            f"unknown cache type {name!r}; known types: {', '.join(available_layers())} (a type from another "
            "module needs `cache.plugins: [module]` or hybridcache.cache.load_plugins)"
        ) from None
