"""The registry of cache layer types: `@register_cache_layer("name")` adds one, `available_layers()` lists them."""

from __future__ import annotations

from typing import Callable, TypeVar

from hybridcache.cache.base import CacheLayer, LayerSpec
from hybridcache.cache.errors import CacheConfigError

_REGISTRY: dict[str, type[CacheLayer]] = {}
L = TypeVar("L", bound=type[CacheLayer])


def register_cache_layer(name: str, *, replace: bool = False) -> Callable[[L], L]:
    """Class decorator: register a `CacheLayer` subclass under `name` so cache configs can ask for it."""
    if not isinstance(name, str) or not name.isidentifier():
        raise CacheConfigError(f"cache type names must be identifiers, got {name!r}")
    if name in ("attention", "recurrent", "layers", "type"):
        raise CacheConfigError(f"'{name}' is reserved in cache configs and cannot name a cache type")

    def decorate(cls: L) -> L:
        if not (isinstance(cls, type) and issubclass(cls, CacheLayer)):
            raise CacheConfigError(f"@register_cache_layer('{name}') needs a CacheLayer subclass, got {cls!r}")
        if getattr(cls, "kind", None) not in ("attention", "recurrent"):
            raise CacheConfigError(f"{cls.__name__}.kind must be 'attention' or 'recurrent'")
        if not (isinstance(getattr(cls, "spec_cls", None), type) and issubclass(cls.spec_cls, LayerSpec)):
            raise CacheConfigError(f"{cls.__name__}.spec_cls must be a LayerSpec subclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls and not replace:
            raise CacheConfigError(f"cache type '{name}' is already registered ({_REGISTRY[name].__name__})")
        cls.type_name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def available_layers(kind: str | None = None) -> list[str]:
    """Names of the registered cache layer types, optionally only those of one kind."""
    return sorted(n for n, c in _REGISTRY.items() if kind is None or c.kind == kind)


def get_layer_class(name: str) -> type[CacheLayer]:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise CacheConfigError(
            f"unknown cache type {name!r}; known types: {', '.join(available_layers())}"
        ) from None
