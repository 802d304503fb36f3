"""Shape checks for snapshots put back with `Cache.restore` (a hand-made snapshot or a crafted cache file must not
leave a layer with tensors its mixers cannot use)."""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.cache.core.base import CacheLayer
from hybridcache.cache.core.errors import CacheError


def check_snapshot_shapes(i: int, layer: CacheLayer, snap: Any) -> None:
    """Every tensor of a layer snapshot has the layer's shape in each dimension its spec fixes (the dimensions a
    freshly built layer of the same spec gives a non-zero size; a size-0 dimension grows with what is stored)."""
    for name, t in snap.tensors.items():
        ref = _stored_shapes(type(layer), layer.spec).get(name)
        if ref is None or len(ref) != t.dim():
            continue  # a name or rank the layer's own check refuses
        if any(want not in (None, "B") and got != want for got, want in zip(t.shape, ref)):
            want = ", ".join("*" if d is None else str(d) for d in ref)
            raise CacheError(
                f"snapshot layer {i} ({layer.type_name}): tensor '{name}' has shape "
                f"{tuple(t.shape)}, this layer stores [{want}]"
            )
    pos = snap.tensors.get("key_pos")
    if layer.kind == "attention" and isinstance(pos, torch.Tensor) and pos.dim() >= 2:
        for name in _PER_SLOT:  # one stored token per slot: as many slots as key_pos holds positions
            t = snap.tensors.get(name)
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2] != pos.shape[-1]:
                raise CacheError(
                    f"snapshot layer {i} ({layer.type_name}): tensor '{name}' holds {t.shape[2]} slots, "
                    f"'key_pos' {pos.shape[-1]}"
                )
    check_snapshot_positions(i, layer, snap)


#: Attention storage tensors [B, H, S, *] with one token per slot of `key_pos` (dense, int8 and int4 storage).
_PER_SLOT = ("keys_data", "values_data", "keys_q", "keys_scale", "values_q", "values_scale")
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
    shapes = {
        name: tuple("B" if d == 0 and name in batch else (n or None) for d, n in enumerate(t.shape))
        for name, t in layer._state_tensors().items()
    }
    try:
        _SHAPES[cls, spec] = shapes
    except TypeError:  # an unhashable spec: not remembered
        pass
    return shapes


def check_snapshot_positions(i: int, layer: CacheLayer, snap: Any) -> None:
    """The positions a snapshot stores agree with its sequence state (`seen` [B], `columns`), by the conventions
    the layers keep (attention.py, residual_window.py, recurrent.py):
    - `key_pos` [B, (H,) S] / `res_pos` [B, R]: -1 (empty slot or padding) or a position in [0, seen of the row),
      each held at most once per row (and head);
    - preallocated attention (`max_length`): position p sits in slot `spec.slot_of(p)`;
    - dynamic attention evicting by its pattern only (full, sliding, chunked, sink): a row's slots are -1 (left
      padding) then strictly increasing positions, and they hold every token the row's next query sees;
    - recurrent `trail_columns` [k]: -1 or a column in [columns - k, columns), increasing."""
    seen, columns = snap.seen, snap.columns
    where = f"snapshot layer {i} ({layer.type_name})"
    for name in ("key_pos", "res_pos"):
        t = snap.tensors.get(name)
        if t is None or t.dtype != torch.long or t.dim() < 2 or t.shape[0] != seen.shape[0] or not t.numel():
            continue  # absent, or a tensor the layer's own checks refuse
        rows = seen.to(t.device).view(-1, *([1] * (t.dim() - 1)))
        bad = (t < -1) | (t >= rows)
        if bool(bad.any()):
            at = bad.nonzero()[0].tolist()
            raise CacheError(
                f"{where}: '{name}' holds position {int(t[tuple(at)])} in row {at[0]}, which has seen "
                f"{int(seen[at[0]])} tokens (positions are -1 or in [0, seen))"
            )
        s = t.sort(-1).values
        if bool(((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any()):
            raise CacheError(f"{where}: '{name}' holds a position twice in one row")
    pos = snap.tensors.get("key_pos")
    if (
        layer.kind == "attention"
        and isinstance(pos, torch.Tensor)
        and pos.dim() == 2
        and pos.numel()
        and pos.dtype == torch.long
        and pos.shape[0] == seen.shape[0]
    ):
        _check_key_layout(where, layer, pos, seen.to(pos.device))
    trail = snap.tensors.get("trail_columns")
    if layer.kind == "recurrent" and isinstance(trail, torch.Tensor) and trail.dim() == 1 and trail.numel():
        held = trail[trail >= 0]
        k = trail.numel()
        if (
            bool((trail < -1).any())
            or bool((held < max(0, columns - k)).any())
            or bool((held >= columns).any())
            or bool((held[1:] <= held[:-1]).any())
        ):
            raise CacheError(
                f"{where}: 'trail_columns' {trail.tolist()} are not -1 or increasing columns in "
                f"[{max(0, columns - k)}, {columns}) (the cache has {columns} columns)"
            )


def _check_key_layout(where: str, layer: Any, pos: torch.Tensor, seen: torch.Tensor) -> None:
    spec, held = layer.spec, pos >= 0
    if getattr(spec, "slots", None) is not None:  # preallocated: the spec's layout places every position
        slots = torch.arange(pos.shape[1], device=pos.device).expand_as(pos)
        if bool((held & (spec.slot_of(pos.clamp(min=0)) != slots)).any()):
            raise CacheError(f"{where}: a stored position is not in the slot the preallocated layout puts it in")
        ordered = True
    else:
        ordered = bool(((pos[:, 1:] > pos[:, :-1]) | ((pos[:, 1:] == -1) & (pos[:, :-1] == -1))).all())
    if getattr(layer, "own_eviction", False):
        return  # a score-based eviction keeps any subset, in its own order
    if not ordered:
        raise CacheError(f"{where}: stored positions must be -1 (left padding) then increasing along the slots")
    have = (held & spec.visible(seen[:, None], pos)).sum(1)
    need = spec.needed_tokens(seen)
    if bool((have < need).any()):
        row = int((have < need).nonzero()[0])
        raise CacheError(
            f"{where}: row {row} has seen {int(seen[row])} tokens and holds {int(have[row])} of the "
            f"{int(need[row])} its next query sees"
        )
