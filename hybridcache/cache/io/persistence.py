"""Saving and loading a `Cache`: safetensors for the tensors, a small JSON header, a sha256 of the payload. No pickle.

File layout: one safetensors file. Its tensors are every cache layer's storage (`layers.<i>.<name>`) plus the
sequence state (`sequence.seen`, `sequence.fingerprint` and its per-column `sequence.fingerprint_history`); its
metadata holds one JSON document under "hybridcache":

    {"format": "hybridcache.cache", "version": 2,
     "model": {"family", "config_sha256", "weights_sha256"},      # who the cache belongs to
     "batch_size", "columns", "has_fingerprint",
     "layers": [{"index", "member", "native_type", "type", "spec": {...}, "tensors": [...]}, ...],
     "payload_sha256": sha256 over every tensor (name, dtype, shape, bytes, in name order),
     "signature": {"alg": "hmac-sha256", "value"},                # only when saved with key=
     "header_sha256": sha256 of this document without this field (canonical JSON, sorted keys)}

The two sha256 detect corruption, not tampering: anyone can recompute them. `key=` adds an HMAC-SHA256 of the header
(which carries the payload's sha256) under the caller's key; a load with `key=` refuses unsigned or wrongly signed
files. Signed or not, a file is treated as untrusted: `load` checks, before allocating anything, the format and
version, the hashes (and signature), every header field's type, the tensors present against the header (names,
dtypes, shapes, batch rows, columns, within sane limits), the model's identity, the batch size and cache config
if the caller names them, and that each layer's spec fits the model; `restore` then checks the stored positions
against the sequence state (snapshot_check.py). Every failure is a `CacheFileError` saying what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from hybridcache.cache.core.base import LayerSnapshot
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.plan import CachePlan
from hybridcache.cache.core.registry import get_layer_class
from hybridcache.cache.core.snapshot import CacheSnapshot
from hybridcache.cache.core.snapshot_check import check_snapshot_shapes
from hybridcache.cache.core.tensor_bytes import byte_view, dense
from hybridcache.cache.io.file_header import (
    CacheFileError,
    header_field,
    layer_plans,
    no_json_constants,
    sequence_tensors,
)
from hybridcache.cache.io.model_identity import model_identity
from hybridcache.util.atomic_files import check_replaceable, write_atomically


class SavedCache(Protocol):
    """What this module needs of a `Cache` (it never imports cache.py: the Cache delegates to it, not back)."""

    plan: CachePlan | None
    layers: list
    seq: Any
    batch_size: int
    columns: int
    device: torch.device

    def _operation(self, what: str) -> Any: ...
    def restore(self, snap: CacheSnapshot) -> None: ...


FORMAT, VERSION = "hybridcache.cache", 2  # 2: the header carries its own sha256
SIGNATURE_ALG = "hmac-sha256"


# -- hashes and the signature ---------------------------------------------------------------------------------
def _canonical(header: Mapping[str, Any], leave_out: tuple[str, ...]) -> bytes:
    return json.dumps({k: v for k, v in header.items() if k not in leave_out}, sort_keys=True).encode()


def header_sha256(header: Mapping[str, Any]) -> str:
    """sha256 of the header's canonical JSON (sorted keys), without its own `header_sha256` field."""
    return hashlib.sha256(_canonical(header, ("header_sha256",))).hexdigest()


def header_signature(header: Mapping[str, Any], key: bytes) -> str:
    """HMAC-SHA256 under `key` of the header's canonical JSON without `signature` and `header_sha256` (the header
    carries `payload_sha256`, so the signature covers every tensor byte too)."""
    return hmac.new(key, _canonical(header, ("signature", "header_sha256")), hashlib.sha256).hexdigest()


def check_key(key: Any) -> bytes | None:
    if key is None:
        return None
    if not isinstance(key, (bytes, bytearray, memoryview)) or not len(key):
        raise CacheError(
            f"key must be non-empty bytes (e.g. os.urandom(32), shared with the loading side), got {type(key).__name__}"
        )
    return bytes(key)


def payload_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(byte_view(t))
    return h.hexdigest()


# -- specs as JSON ----------------------------------------------------------------------------------------------
def _encode_value(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return {"tuple": [_encode_value(v) for v in value]}
    raise CacheError(f"cannot save a spec field of type {type(value).__name__} ({value!r}) as JSON")


def _spec_record(spec: Any) -> dict[str, Any]:
    return {f.name: _encode_value(getattr(spec, f.name)) for f in dataclasses.fields(spec)}


# -- save ---------------------------------------------------------------------------------------------------------
def save_cache(cache: SavedCache, path: str | os.PathLike, model: torch.nn.Module, key: bytes | None = None) -> Path:
    """Write `cache` (no block open) to `path` atomically; `model` is the model it belongs to; `key` signs it."""
    if cache.plan is None:
        raise CacheError("Cache.save: this cache was assembled by hand (no plan); build it with model.make_cache")
    key, path = check_key(key), Path(path)
    check_replaceable(path, CacheError, "Cache.save")  # before any work: a FIFO, a device, a missing directory
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
            layers.append(
                {
                    "index": plan.index,
                    "member": plan.member,
                    "native_type": plan.native_type,
                    "type": plan.type,
                    "spec": _spec_record(layer.spec),
                    "tensors": sorted(layer._state_tensors()),
                }
            )
        tensors = {k: dense(v) for k, v in tensors.items()}
        header = {
            "format": FORMAT,
            "version": VERSION,
            "model": model_identity(model),
            "batch_size": cache.batch_size,
            "columns": cache.columns,
            "has_fingerprint": cache.seq.fingerprint is not None,
            "layers": layers,
            "payload_sha256": payload_sha256(tensors),
        }
        if key is not None:
            header["signature"] = {"alg": SIGNATURE_ALG, "value": header_signature(header, key)}
        header["header_sha256"] = header_sha256(header)
        data = st_save(tensors, metadata={"hybridcache": json.dumps(header)})
    write_atomically(path, data, CacheError, "Cache.save")
    return path


# -- load ---------------------------------------------------------------------------------------------------------
def read_cache_file(
    path: str | os.PathLike, key: bytes | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The verified header and tensors of a saved cache (format, version, hashes and, with `key`, the signature)."""
    path, key = Path(path), check_key(key)
    if not path.is_file():
        raise FileNotFoundError(f"no saved cache at {path}")
    data = path.read_bytes()
    try:
        tensors = st_load(data)
        meta = _metadata(data)
    except (SafetensorError, ValueError, json.JSONDecodeError) as e:
        raise CacheFileError(
            f"{path} is not a readable safetensors cache file (corrupted or truncated?): {e}"
        ) from None
    raw = meta.get("hybridcache") if isinstance(meta, dict) else None
    if not isinstance(raw, str):
        raise CacheFileError(f"{path} is a safetensors file but not a saved hybridcache Cache (no header)")
    try:
        header = json.loads(raw, parse_constant=no_json_constants)
    except (ValueError, RecursionError) as e:
        raise CacheFileError(f"{path}: the cache header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise CacheFileError(f"{path}: not a hybridcache cache file (format {got!r})")
    if header.get("version") != VERSION:
        raise CacheFileError(
            f"{path}: cache file format version {header.get('version')!r}; this hybridcache reads version {VERSION}"
        )
    if header_sha256(header) != header.get("header_sha256"):
        raise CacheFileError(f"{path}: the cache header does not match its sha256 (the file was edited or corrupted)")
    if key is not None:
        sig = header.get("signature")
        if sig is None:
            raise CacheFileError(f"{path} is not signed, and a key was given: refusing an unsigned cache file")
        if (
            not isinstance(sig, dict)
            or sig.get("alg") != SIGNATURE_ALG
            or not isinstance(sig.get("value"), str)
            or not hmac.compare_digest(sig["value"], header_signature(header, key))
        ):
            raise CacheFileError(
                f"{path}: the signature does not match this key (another key, or the file was altered)"
            )
    if payload_sha256(tensors) != header.get("payload_sha256"):
        raise CacheFileError(f"{path}: the tensor payload does not match its sha256 (the file is corrupted)")
    return header, tensors


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (the file was already parsed, so the length is valid)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]).get("__metadata__") or {}


@dataclasses.dataclass(frozen=True)
class SavedState:
    """A verified cache file: the plan to build the cache from, its rows, and the snapshot to restore (on CPU)."""

    path: Path
    plan: CachePlan
    batch_size: int
    snapshot: CacheSnapshot
    device: torch.device | None


def read_saved_cache(
    path: str | os.PathLike,
    model: torch.nn.Module,
    batch_size: int | None = None,
    cache_config: Mapping[str, Any] | None = None,
    key: bytes | None = None,
) -> SavedState:
    """Read and check a saved cache for `model` (see the module docstring for what is checked, and in which order);
    `Cache.load` builds the cache from the plan and fills it with `fill_saved_cache`."""
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "native_layers", None)):
        raise CacheError(
            f"Cache.load: model must be the hybridcache model the cache was saved from, got {type(model).__name__}"
        )
    path = Path(path)
    header, tensors = read_cache_file(path, key)
    got = header_field(header, "model", (dict,), "", path)
    for name in ("family", "config_sha256", "weights_sha256"):
        header_field(got, name, (str,), "model.", path)
    want = model_identity(model)
    if want != got:
        what = [k for k in ("family", "config_sha256", "weights_sha256") if want.get(k) != got.get(k)]
        raise CacheFileError(
            f"{path} was saved from a {got.get('family')!r} model that differs from this {want['family']!r} model in "
            f"{', '.join(what)}; a cache only fits the model (config and weights) that filled it"
        )
    batch, columns, seen, fp, history = sequence_tensors(header, tensors, path)
    if batch_size is not None and batch_size != batch:
        raise CacheFileError(f"{path} holds a batch of {batch} rows, batch_size={batch_size} was asked for")
    records = layer_plans(header, path)
    natives = model.native_layers()
    for i, (p, _) in enumerate(records):  # the native type each record claims is the model's own at that layer
        native = natives[p.index] if 0 <= p.index < len(natives) else None
        if p.member is not None:  # a group's member (FalconH1's attention and mamba of one decoder layer)
            members = getattr(native, "members", None)
            native = members.get(p.member) if isinstance(members, Mapping) else None
        if getattr(native, "type", None) != p.native_type:
            raise CacheFileError(
                f"{path}: 'layers[{i}].native_type' is {p.native_type!r}, this model's layer "
                f"{p.index} is {getattr(native, 'type', None)!r}"
            )
    listed = {f"layers.{i}.{n}" for i, (_, names) in enumerate(records) for n in names}
    extra = set(tensors) - listed - {"sequence.seen", "sequence.fingerprint", "sequence.fingerprint_history"}
    if extra or not listed <= set(tensors):
        odd = sorted(extra) or sorted(listed - set(tensors))
        raise CacheFileError(f"{path}: the tensors present and the header's layer records disagree ({odd[:4]})")
    plan = CachePlan(tuple(p for p, _ in records))
    # every stored tensor is matched with the storage it will fill on layers built on the meta device first: nothing
    # the header sizes is allocated before that, so the file's own size bounds what loading allocates
    snaps = []
    for i, (p, names) in enumerate(records):
        snap = LayerSnapshot(p.type, p.spec, columns, seen, {n: tensors[f"layers.{i}.{n}"] for n in names})
        try:
            layer = get_layer_class(p.type)(p.spec, batch, "meta")
            layer._prepare_restore(snap)
            check_snapshot_shapes(i, layer, snap)
        except (CacheError, TypeError, OverflowError, RuntimeError) as e:  # a spec no layer can be built from, too
            raise CacheFileError(f"{path}: the stored tensors do not match the header's layer {i}: {e}") from None
        snaps.append(snap)
    if cache_config is not None:
        asked = model.make_cache(batch, cache_config).plan
        changed = plan.changed(asked) if len(asked) == len(plan) else ["all"]
        if changed:
            raise CacheFileError(
                f"{path}: the saved cache's layers {', '.join(changed)} differ from what "
                "cache_config asks for (type or parameters)"
            )
    snap = CacheSnapshot(tuple(snaps), seen, columns, fp, history)
    return SavedState(path, plan, batch, snap, getattr(model, "device", None))


def fill_saved_cache(cache: SavedCache, saved: SavedState, model: torch.nn.Module) -> None:
    """Restore `saved` into `cache` (freshly built from `saved.plan`), after checking it fits `model`."""
    path, snap = saved.path, saved.snapshot
    try:
        model.check_cache(cache, saved.batch_size)
    except ValueError as e:
        raise CacheFileError(f"{path} does not fit this model: {e}") from None
    to = cache.device
    layers = tuple(
        LayerSnapshot(s.type_name, s.spec, s.columns, s.seen.to(to), {n: t.to(to) for n, t in s.tensors.items()})
        for s in snap.layers
    )

    def moved(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(to)

    try:
        cache.restore(
            CacheSnapshot(layers, snap.seen.to(to), snap.columns, moved(snap.fingerprint), moved(snap.history))
        )
    except CacheError as e:
        raise CacheFileError(f"{path}: the saved tensors do not fit the cache layers ({e})") from None
