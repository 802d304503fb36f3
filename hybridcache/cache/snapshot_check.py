"""Shape checks for snapshots put back with `Cache.restore` (a hand-made snapshot or a crafted cache file must not
leave a layer with tensors its mixers cannot use)."""

from __future__ import annotations

from typing import Any

from hybridcache.cache.base import CacheLayer
from hybridcache.cache.errors import CacheError


def check_snapshot_shapes(i: int, layer: CacheLayer, snap: Any) -> None:
    """Every tensor of a layer snapshot has the layer's shape in each dimension its spec fixes (the dimensions a
    freshly built layer of the same spec gives a non-zero size; a size-0 dimension grows with what is stored)."""
    for name, t in snap.tensors.items():
        ref = _stored_shapes(type(layer), layer.spec).get(name)
        if ref is None or len(ref) != t.dim():
            continue  # a name or rank the layer's own check refuses
        if any(want not in (None, "B") and got != want for got, want in zip(t.shape, ref)):
            want = ", ".join("*" if d is None else str(d) for d in ref)
            raise CacheError(f"snapshot layer {i} ({layer.type_name}): tensor '{name}' has shape {tuple(t.shape)}, this "
                             f"layer stores [{want}]")


_SHAPES: dict[Any, dict[str, tuple]] = {}


def _stored_shapes(cls: type, spec: Any) -> dict[str, tuple]:
    """Per stored tensor of a `cls` layer with `spec`: its fixed size per dimension (None where it grows with what
    is stored, "B" for the batch), from a layer built on the meta device (remembered per spec)."""
    try:
        return _SHAPES[cls, spec]
    except (KeyError, TypeError):
        pass
    layer = cls(spec, 1, "meta")
    batch = set(layer._batch_tensors)
    shapes = {name: tuple("B" if d == 0 and name in batch else (n or None) for d, n in enumerate(t.shape))
              for name, t in layer._state_tensors().items()}
    try:
        _SHAPES[cls, spec] = shapes
    except TypeError:  # an unhashable spec: not remembered
        pass
    return shapes
