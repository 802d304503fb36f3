"""Saving and loading a `Cache`: safetensors for the tensors, a small JSON header, a sha256 of the payload. No pickle.

File layout: one safetensors file. Its tensors are every cache layer's storage (`layers.<i>.<name>`) plus the
sequence state (`sequence.seen`, `sequence.fingerprint` and its per-column `sequence.fingerprint_history`); its metadata holds one JSON document under "hybridcache":

    {"format": "hybridcache.cache", "version": 2,
     "model": {"family", "config_sha256", "weights_sha256"},      # who the cache belongs to
     "batch_size", "columns", "has_fingerprint",
     "layers": [{"index", "member", "native_type", "type", "spec": {...}}, ...],
     "payload_sha256": sha256 over every tensor (name, dtype, shape, bytes, in name order),
     "header_sha256": sha256 of this document without this field (canonical JSON, sorted keys)}

`load` checks, before building anything: the format and version, the header's and the payload's hashes (an edited
header, a corrupted or truncated file
fails here or in the safetensors parser), the model's identity, the batch size and cache config if the caller
names them, and that each layer's spec fits the model. Every failure is a `CacheFileError` saying what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load, save as st_save

from hybridcache.cache.base import LayerSnapshot
from hybridcache.cache.errors import CacheError
from hybridcache.cache.plan import CachePlan, LayerPlan
from hybridcache.cache.registry import get_layer_class

if TYPE_CHECKING:
    from hybridcache.cache.cache import Cache

FORMAT, VERSION = "hybridcache.cache", 2  # 2: the header carries its own sha256
_SAMPLE = 4096  # elements per parameter that enter the weights digest (first and last ones)


class CacheFileError(CacheError):
    """A saved cache that cannot be loaded here: corrupted, truncated, another format, or another model/batch/spec."""


def model_identity(model: torch.nn.Module) -> dict[str, str]:
    """Who a cache belongs to: the family, a sha256 of its config, a sha256 of its weights (names, shapes, dtypes
    and the first and last 4096 values of every parameter, so two checkpoints of one config differ)."""
    config = json.dumps(getattr(model, "config", {}), sort_keys=True, default=str)
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        sample = flat if flat.numel() <= 2 * _SAMPLE else torch.cat([flat[:_SAMPLE], flat[-_SAMPLE:]])
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|".encode())
        h.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return {"family": str(getattr(model, "family", type(model).__name__)),
            "config_sha256": hashlib.sha256(config.encode()).hexdigest(), "weights_sha256": h.hexdigest()}


def header_sha256(header: Mapping[str, Any]) -> str:
    """sha256 of the header's canonical JSON (sorted keys), without its own `header_sha256` field."""
    body = {k: v for k, v in header.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def payload_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _encode_value(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return {"tuple": [_encode_value(v) for v in value]}
    raise CacheError(f"cannot save a spec field of type {type(value).__name__} ({value!r}) as JSON")


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"dtype"}:
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CacheFileError(f"unknown dtype {value['dtype']!r} in the cache file")
        return dtype
    if isinstance(value, dict) and set(value) == {"tuple"}:
        return tuple(_decode_value(v) for v in value["tuple"])
    return value


def _spec_record(spec: Any) -> dict[str, Any]:
    return {f.name: _encode_value(getattr(spec, f.name)) for f in dataclasses.fields(spec)}


def save_cache(cache: "Cache", path: str | os.PathLike, model: torch.nn.Module) -> Path:
    """Write `cache` (no block open) to `path` atomically; `model` is the model it belongs to."""
    if cache.plan is None:
        raise CacheError("Cache.save: this cache was assembled by hand (no plan); build it with model.make_cache")
    path = Path(path)
    with cache._operation("save"):
        tensors: dict[str, torch.Tensor] = {"sequence.seen": cache.seq.seen}
        if cache.seq.fingerprint is not None:
            tensors["sequence.fingerprint"] = cache.seq.fingerprint
            history = cache.seq.history()  # [B, columns]: lets a loaded cache be cropped and still be continued
            if history is not None:
                tensors["sequence.fingerprint_history"] = history
        layers = []
        for i, (plan, layer) in enumerate(zip(cache.plan.layers, cache.layers, strict=True)):
            if plan.spec != layer.spec or plan.type != layer.type_name:
                raise CacheError(f"Cache.save: layer {i} no longer matches the cache's plan")
            for name, t in layer._state_tensors().items():
                tensors[f"layers.{i}.{name}"] = t
            layers.append({"index": plan.index, "member": plan.member, "native_type": plan.native_type,
                           "type": plan.type, "spec": _spec_record(layer.spec),
                           "tensors": sorted(layer._state_tensors())})
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        header = {"format": FORMAT, "version": VERSION, "model": model_identity(model),
                  "batch_size": cache.batch_size, "columns": cache.columns,
                  "has_fingerprint": cache.seq.fingerprint is not None, "layers": layers,
                  "payload_sha256": payload_sha256(tensors)}
        header["header_sha256"] = header_sha256(header)
        data = st_save(tensors, metadata={"hybridcache": json.dumps(header)})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def read_cache_file(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The verified header and tensors of a saved cache (format, version and payload hash checked)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no saved cache at {path}")
    data = path.read_bytes()
    try:
        tensors = st_load(data)
        meta = _metadata(data)
    except (SafetensorError, ValueError, json.JSONDecodeError) as e:
        raise CacheFileError(f"{path} is not a readable safetensors cache file (corrupted or truncated?): {e}") from None
    raw = meta.get("hybridcache")
    if raw is None:
        raise CacheFileError(f"{path} is a safetensors file but not a saved hybridcache Cache (no header)")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CacheFileError(f"{path}: the cache header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CacheFileError(f"{path}: not a hybridcache cache file (format {header.get('format')!r})")
    if header.get("version") != VERSION:
        raise CacheFileError(f"{path}: cache file format version {header.get('version')!r}; this hybridcache reads "
                             f"version {VERSION}")
    if header_sha256(header) != header.get("header_sha256"):
        raise CacheFileError(f"{path}: the cache header does not match its sha256 (the file was edited or corrupted)")
    if payload_sha256(tensors) != header.get("payload_sha256"):
        raise CacheFileError(f"{path}: the tensor payload does not match its sha256 (the file is corrupted)")
    return header, tensors


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (the file was already parsed, so the length is valid)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]).get("__metadata__") or {}


def load_cache(path: str | os.PathLike, model: torch.nn.Module, batch_size: int | None = None,
               cache_config: Mapping[str, Any] | None = None, device: torch.device | str | None = None) -> "Cache":
    """Rebuild a saved cache for `model` (see the module docstring for what is checked)."""
    from hybridcache.cache.cache import Cache, CacheSnapshot

    header, tensors = read_cache_file(path)
    want, got = model_identity(model), header.get("model") or {}
    if want != got:
        what = [k for k in ("family", "config_sha256", "weights_sha256") if want.get(k) != got.get(k)]
        raise CacheFileError(
            f"{path} was saved from a {got.get('family')!r} model that differs from this {want['family']!r} model in "
            f"{', '.join(what)}; a cache only fits the model (config and weights) that filled it")
    batch = int(header["batch_size"])
    if batch_size is not None and batch_size != batch:
        raise CacheFileError(f"{path} holds a batch of {batch} rows, batch_size={batch_size} was asked for")
    try:
        plans = tuple(LayerPlan(int(r["index"]), r["native_type"], r["type"],
                                get_layer_class(r["type"]).spec_cls(**{k: _decode_value(v) for k, v in r["spec"].items()}),
                                r["member"]) for r in header["layers"])
    except (KeyError, TypeError) as e:
        raise CacheFileError(f"{path}: bad layer record in the cache header ({e})") from None
    plan = CachePlan(plans)
    if cache_config is not None:
        asked = model.make_cache(batch, cache_config).plan
        changed = plan.changed(asked) if len(asked) == len(plan) else ["all"]
        if changed:
            raise CacheFileError(f"{path}: the saved cache's layers {', '.join(changed)} differ from what "
                                 "cache_config asks for (type or parameters)")
    cache = Cache.from_plan(plan, batch, device if device is not None else getattr(model, "device", None))
    try:
        model.check_cache(cache, batch)
    except ValueError as e:
        raise CacheFileError(f"{path} does not fit this model: {e}") from None
    seen = tensors["sequence.seen"].to(cache.device)
    columns = int(header["columns"])
    snaps = []
    for i, layer in enumerate(cache.layers):
        names = header["layers"][i].get("tensors", [])
        layer_t = {n: tensors[f"layers.{i}.{n}"].to(cache.device) for n in names if f"layers.{i}.{n}" in tensors}
        snaps.append(LayerSnapshot(layer.type_name, layer.spec, columns, seen, layer_t))
    fp = tensors.get("sequence.fingerprint") if header.get("has_fingerprint") else None
    history = tensors.get("sequence.fingerprint_history") if fp is not None else None
    try:
        cache.restore(CacheSnapshot(tuple(snaps), seen, columns, None if fp is None else fp.to(cache.device),
                                    None if history is None else history.to(cache.device)))
    except CacheError as e:
        raise CacheFileError(f"{path}: the saved tensors do not fit the cache layers ({e})") from None
    return cache
