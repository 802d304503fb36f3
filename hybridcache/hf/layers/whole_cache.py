"""HF's per-layer batch operations, which the bridge runs on the whole cache at once (BridgeCache.crop, ...): every
bridge layer refuses them by name, so no layer of ours changes apart from the others and their sequence state."""

from __future__ import annotations

from typing import Any, NoReturn, TypeVar

from hybridcache.hf.errors import BridgeError

WHOLE_CACHE_OPS = ("crop", "reorder_cache", "batch_repeat_interleave", "batch_select_indices", "reset")
T = TypeVar("T", bound=type)


def _refusal(name: str):
    def refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise BridgeError(f"{name} acts on the whole cache at once: call it on the BridgeCache, not on one layer")

    refuse.__name__ = name
    return refuse


def _no_offload(self) -> None:
    """Offloading is a storage choice of ours (`storage: offload`, `offload: true`), not HF's per-layer one."""


def whole_cache_only(cls: T) -> T:
    """Class decorator: the refusals (and a no-op offload / prefetch) defined on the class itself, so they win over
    HF's mixins' versions whatever the order of its bases."""
    for name in WHOLE_CACHE_OPS:
        setattr(cls, name, _refusal(name))
    cls.offload = cls.prefetch = _no_offload
    return cls
