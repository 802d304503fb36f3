"""Reading an untrusted cache-file header (persistence.py): every field typed and bounded, every size checked
against the tensors actually present, before anything is allocated. Each failure is a `CacheFileError` naming the
field (`layers[2].spec.window`, `batch_size`, ...)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.plan import RENAMED_PARAMETERS, LayerPlan
from hybridcache.cache.core.registry import get_layer_class

MAX_BATCH, MAX_COLUMNS = 1 << 20, 1 << 32  # far beyond any real cache: a header claiming more is forged
_FP_MOD = 2_147_483_647  # the token fingerprint's modulus (sequence.py)


class CacheFileError(CacheError):
    """A saved cache that cannot be loaded here: corrupted, truncated, forged, another format, or another
    model/batch/spec."""


def no_json_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _decode_value(value: Any, where: str) -> Any:
    if isinstance(value, dict) and set(value) == {"dtype"}:
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CacheFileError(f"{where}: unknown dtype {value['dtype']!r}")
        return dtype
    if isinstance(value, dict) and set(value) == {"tuple"} and isinstance(value["tuple"], list):
        return tuple(_decode_value(v, where) for v in value["tuple"])
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CacheFileError(f"{where}: a spec value must be a number, string, null, dtype or tuple, got {value!r}")


def header_field(record: Mapping[str, Any], name: str, kinds: tuple[type, ...], where: str, path: Path) -> Any:
    """record[name], which must be one of `kinds` (an int is never a bool)."""
    if name not in record:
        raise CacheFileError(f"{path}: the cache header has no '{where}{name}' field")
    value = record[name]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        want = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise CacheFileError(f"{path}: the cache header's '{where}{name}' must be {want}, got {value!r}"[:300])
    return value


def _count(record: Mapping[str, Any], name: str, low: int, high: int, path: Path) -> int:
    value = header_field(record, name, (int,), "", path)
    if not low <= value <= high:
        raise CacheFileError(f"{path}: the cache header's '{name}' is {value}, outside [{low}, {high}]")
    return value


def _renamed_fields(record: dict[str, Any], spec_cls: type) -> dict[str, Any]:
    """A spec record saved before a field's rename, under the new names (a press's `mode` is `schedule` since
    2026-11-29), so files saved before it still load."""
    names = {f.name for f in dataclasses.fields(spec_cls)}
    old = {k: v for k, v in RENAMED_PARAMETERS.items() if k in record and k not in names and v in names}
    return {old.get(k, k): v for k, v in record.items()}


def layer_plans(header: Mapping[str, Any], path: Path) -> list[tuple[LayerPlan, list[str]]]:
    """Each layer record as a plan (spec validated by its own class) and its tensor names; the records must
    describe decoder layers in order (a single layer, or the members of one group)."""
    out: list[tuple[LayerPlan, list[str]]] = []
    for i, r in enumerate(header_field(header, "layers", (list,), "", path)):
        where = f"layers[{i}]."
        if not isinstance(r, dict):
            raise CacheFileError(f"{path}: the cache header's 'layers[{i}]' must be an object, got {r!r}"[:300])
        index = header_field(r, "index", (int,), where, path)
        member = header_field(r, "member", (str, type(None)), where, path)
        native, kind = (header_field(r, k, (str,), where, path) for k in ("native_type", "type"))
        spec, names = header_field(r, "spec", (dict,), where, path), header_field(r, "tensors", (list,), where, path)
        last = out[-1][0] if out else None
        new_entry = index == (0 if last is None else last.index + 1)
        same_group = (
            last is not None
            and index == last.index
            and member is not None
            and last.member is not None
            and member not in {p.member for p, _ in out if p.index == index}
        )
        if not (new_entry or same_group):
            raise CacheFileError(
                f"{path}: the cache header's '{where}index' {index} (member {member!r}) does not "
                "follow the layers before it"
            )
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise CacheFileError(f"{path}: the cache header's '{where}tensors' must be distinct names")
        try:
            cls = get_layer_class(kind)
            spec = _renamed_fields(spec, cls.spec_cls)
            spec = cls.spec_cls(**{k: _decode_value(v, f"{path}: '{where}spec.{k}'") for k, v in spec.items()})
        except CacheFileError:
            raise
        except (CacheError, TypeError, ValueError, KeyError) as e:
            raise CacheFileError(
                f"{path}: the cache header's '{where}spec' / '{where}type' is not a valid '{kind}' layer: {e}"[:500]
            ) from None
        out.append((LayerPlan(index, native, kind, spec, member), names))
    if not out:
        raise CacheFileError(f"{path}: the cache header's 'layers' is empty")
    return out


def sequence_tensors(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], path: Path) -> tuple:
    """(batch, columns, seen, fingerprint, history) checked against each other and the tensors present."""
    batch = _count(header, "batch_size", 1, MAX_BATCH, path)
    columns = _count(header, "columns", 0, MAX_COLUMNS, path)
    has_fp = header_field(header, "has_fingerprint", (bool,), "", path)

    def tensor(name: str, shape: tuple[int, ...], low: int, high: int, bound: str = "") -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            why = "the header's 'has_fingerprint' is true" if name == "sequence.fingerprint" else "always there"
            raise CacheFileError(f"{path}: the cache file has no tensor '{name}' ({why})")
        if t.dtype != torch.long or tuple(t.shape) != shape:
            raise CacheFileError(
                f"{path}: tensor '{name}' is {t.dtype} {tuple(t.shape)}, the header's batch_size "
                f"{batch} and columns {columns} make it int64 {shape}"
            )
        if t.numel() and bool(((t < low) | (t > high)).any()):
            raise CacheFileError(f"{path}: tensor '{name}' holds values outside [{low}, {high}]{bound}")
        return t

    seen = tensor("sequence.seen", (batch,), 0, columns, " (the header's 'columns')")
    if not has_fp and "sequence.fingerprint" in tensors:
        raise CacheFileError(f"{path}: a token fingerprint tensor, and 'has_fingerprint' false in the header")
    fp = tensor("sequence.fingerprint", (batch,), 0, _FP_MOD - 1) if has_fp else None
    history = None
    if "sequence.fingerprint_history" in tensors:
        if not has_fp:
            raise CacheFileError(f"{path}: a token fingerprint history without 'has_fingerprint'")
        history = tensor("sequence.fingerprint_history", (batch, columns), 0, _FP_MOD - 1)
        if columns and not torch.equal(history[:, -1], fp):
            raise CacheFileError(f"{path}: the token fingerprint disagrees with its history's last column")
    return batch, columns, seen, fp, history
