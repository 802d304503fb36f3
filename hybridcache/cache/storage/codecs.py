"""How attention cache layers store the tokens they keep: a codec per storage format.

Which tokens an attention layer keeps is its pattern's business (`full`, `sliding`, `chunked`, ...); how each kept
token's key and value are stored is the codec's. Any pattern takes any codec through the spec field `storage`
(`{"attention": {"storage": "int8"}}`). A codec turns a block x [B, H, T, D] into named parts [B, H, T, ...]
(`encode`) and back (`decode`); storage, eviction, ring buffers and batch operations work on the parts.
A new format is one class: `@register_kv_codec("name")`.

A format may take options from the spec (`options`, e.g. int4's `q_group_size`: `get_codec("int4", q_group_size=16)`),
refuse a head size or dtype (`check`), and keep its parts somewhere other than the layer's device between blocks
(`offloads`: `offload` keeps them in CPU memory or memory-mapped files, see offload.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch

from hybridcache.cache.core.errors import CacheConfigError

Fields = dict[str, tuple[tuple[int, ...], torch.dtype]]  # part name -> (trailing shape per token and head, dtype)


class KVCodec(ABC):
    """A storage format for keys or values. `exact` codecs give back exactly what they were given."""

    name: ClassVar[str] = "?"
    exact: ClassVar[bool] = False
    options: ClassVar[tuple[str, ...]] = ()  # spec fields this format takes, passed to __init__ (e.g. "q_group_size")
    offloads: ClassVar[bool] = False  # the parts live on a slower tier between blocks (offload.py; the layer's
    # storage is then wrapped in cache/attention/storage/offloaded.py)

    def check(self, head_dim: int, dtype: torch.dtype) -> None:
        """Raise CacheConfigError if this format cannot store vectors of `head_dim` elements in `dtype`."""

    @abstractmethod
    def fields(self, head_dim: int, dtype: torch.dtype) -> Fields:
        """The parts stored per token and head, e.g. {"": ((D,), float32)} for dense storage."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [B, H, T, D] -> parts [B, H, T, ...] (shapes and dtypes as in `fields`)."""

    @abstractmethod
    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Parts [B, H, S, ...] -> x [B, H, S, D] in `dtype`."""

    def token_nbytes(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token takes per head."""
        total = 0
        for shape, dt in self.fields(head_dim, dtype).values():
            n = 1
            for s in shape:
                n *= s
            total += n * torch.empty((), dtype=dt).element_size()
        return total


_CODECS: dict[str, type[KVCodec]] = {}
C = TypeVar("C", bound=type[KVCodec])


def registrar(table: dict[str, type], base: type, what: str, decorator: str, field: str) -> Callable[[str], Callable]:
    """A class decorator factory for a table of named formats (storage formats here, state codecs in
    state_codecs.py): identifier names, subclasses of `base` only, a name taken once, a class under one name
    (`field`: the config field that names it)."""

    def register(name: str) -> Callable:
        if not isinstance(name, str) or not name.isidentifier():
            raise CacheConfigError(f"{what} names must be identifiers, got {name!r}")

        def decorate(cls):
            if not (isinstance(cls, type) and issubclass(cls, base)):
                raise CacheConfigError(f"@{decorator}('{name}') needs a {base.__name__} subclass, got {cls!r}")
            if name in table and table[name] is not cls:
                raise CacheConfigError(f"{what} '{name}' is already registered ({table[name].__name__})")
            own = cls.__dict__.get("name")  # set by an earlier registration of this very class
            if own is not None and own != name and table.get(own) is cls:
                raise CacheConfigError(
                    f"{cls.__name__} is already registered as {field} '{own}'; it cannot also be '{name}'"
                )
            cls.name = name
            table[name] = cls
            return cls

        return decorate

    return register


_register_kv_codec = registrar(_CODECS, KVCodec, "storage format", "register_kv_codec", "storage")


def register_kv_codec(name: str) -> Callable[[C], C]:
    """Class decorator: make a `KVCodec` available as `storage: <name>` in cache configs."""
    return _register_kv_codec(name)


def available_codecs() -> list[str]:
    return sorted(_CODECS)


def codec_class(name: str) -> type[KVCodec]:
    if name not in _CODECS:
        raise CacheConfigError(f"unknown attention storage {name!r}; known: {', '.join(available_codecs())}")
    return _CODECS[name]


def get_codec(name: str, **options: Any) -> KVCodec:
    """A codec of format `name`; `options` set to None are left at the format's defaults."""
    if name not in _CODECS:
        raise CacheConfigError(f"unknown attention storage {name!r}; known: {', '.join(available_codecs())}")
    cls = _CODECS[name]
    options = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        takes = f"it takes {', '.join(cls.options)}" if cls.options else "it takes no options"
        raise CacheConfigError(f"storage '{name}' does not take {', '.join(unknown)} ({takes})")
    return cls(**options)


@register_kv_codec("dense")
class DenseCodec(KVCodec):
    """Plain tensors in the layer's dtype."""

    exact = True

    def fields(self, head_dim: int, dtype: torch.dtype) -> Fields:
        return {"": ((head_dim,), dtype)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"": x}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts[""]
