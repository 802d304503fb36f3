"""Attention storages: how an attention cache layer holds its kept tokens (protocol.py), one class per kind, and
`make_storage`, which picks the kind once per layer from its spec and codec:
- `GroupedStorage` (grouped.py): layer-level formats that quantize columns of the whole batch (kivi, hf_quantized);
- `StaticStorage` (static.py): preallocated slots (`max_length`), decode tokens written in place;
- `AppendStorage` (append.py): dense dynamic storage appended in place into spare slots (kernels write into it);
- `CodecStorage` (codec.py): any per-token codec (int8, int4, fp8, ...) with an optional residual window;
- `OffloadedStorage` (offloaded.py): wraps a codec / static storage, its parts on a slower tier (`storage: offload`).
"""

from __future__ import annotations

from typing import Any

from hybridcache.cache.attention.storage.append import AppendStorage
from hybridcache.cache.attention.storage.codec import CodecStorage
from hybridcache.cache.attention.storage.grouped import GroupedStorage
from hybridcache.cache.attention.storage.offloaded import OffloadedStorage
from hybridcache.cache.attention.storage.protocol import AttentionStorage
from hybridcache.cache.attention.storage.static import StaticStorage
from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.cache.storage.codecs import DenseCodec

__all__ = [
    "AppendStorage",
    "AttentionStorage",
    "CodecStorage",
    "GroupedStorage",
    "OffloadedStorage",
    "StaticStorage",
    "make_storage",
]


def make_storage(layer: Any, batch: int) -> AttentionStorage:
    """The storage of attention cache layer `layer` (its spec, device and class flags) for `batch` rows."""
    s, device = layer.spec, layer.device
    codec = s.codec()
    if getattr(codec, "grouped", False):  # kivi / hf_quantized: it owns keys and values
        if layer.own_eviction or s.per_head or layer.wants_attention_weights:
            raise CacheConfigError(
                f"{layer.name}: storage '{codec.name}' quantizes the columns of the whole batch together, so it "
                "cannot follow an eviction that keeps different tokens per row or head (score-based methods); use it "
                "with full, sliding, chunked or sink attention, or a per-token storage (int8, int4) here"
            )
        return GroupedStorage(s, codec, codec.storage(batch, s.num_kv_heads, s.head_dim, s.dtype, device), device)
    offloads = getattr(codec, "offloads", False) and device.type in ("cpu", "cuda")  # "meta": shapes only
    if s.max_length is not None:
        inner: CodecStorage = StaticStorage(s, codec, batch, device)
    elif isinstance(codec, DenseCodec) and not (s.residual or offloads or s.per_head):
        return AppendStorage(s, codec, batch, device)
    else:
        inner = CodecStorage(s, codec, batch, device)
    return OffloadedStorage(inner, layer) if offloads else inner
