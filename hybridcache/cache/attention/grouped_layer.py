"""What an attention cache layer does when its storage is layer-level (grouped_codecs.py: kivi, hf_quantized).

The `GroupedKVStorage` owns keys and values; the layer keeps `key_pos` = the storage's held positions [B, S] (what
masks are built from) and publishes the storage's state as layer tensors `kv_<name>` so that the base snapshot,
restore, shape checks and persistence handle it like any storage: plain ints / bools of the state (columns,
k_start, v_start, armed) become one-element tensors [1] (persistence hashes bytes: a 0-d tensor has no byte view),
tensors whose dim 0 is the batch are batch tensors, the others (HF's scales, grouped across rows) are not. The
hooks in attention.py call these functions (validate, then mutate).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.cache.attention.staging import GroupedWrite
from hybridcache.cache.core.errors import CacheConfigError
from hybridcache.cache.core.sequence import BlockState
from hybridcache.cache.storage.grouped import GroupedKVStorage

PREFIX = "kv_"


def allocate(layer: Any, batch: int) -> GroupedKVStorage | None:
    """The layer's storage (None for a per-token codec); refuses what such a storage cannot follow."""
    layer._grouped_rows = ()
    codec, s = layer.codec, layer.spec
    if not getattr(codec, "grouped", False):
        return None
    if layer.own_eviction or s.per_head or layer.wants_attention_weights:
        raise CacheConfigError(
            f"{layer.name}: storage '{codec.name}' quantizes the columns of the whole batch together, so it cannot "
            "follow an eviction that keeps different tokens per row or head (score-based methods); use it with "
            "full, sliding, chunked or sink attention, or a per-token storage (int8, int4) here"
        )
    storage = codec.storage(batch, s.num_kv_heads, s.head_dim, s.dtype, layer.device)
    publish(layer, storage)
    return storage


def publish(layer: Any, storage: GroupedKVStorage) -> None:
    """Mirror the storage's state on the layer (the tensors themselves: the storage never writes them in place)."""
    rows, other = [], []
    unbatched = getattr(storage, "unbatched", ())
    for name, value in storage.state().items():
        if name == "pos":
            layer.key_pos = value  # [B, S]
            continue
        attr = PREFIX + name
        if isinstance(value, torch.Tensor):
            (other if name in unbatched else rows).append(attr)
        else:
            value, _ = torch.tensor([value], device=layer.device), other.append(attr)  # int -> long, bool -> bool
        setattr(layer, attr, value)
    layer._grouped_rows, layer._other_tensors = tuple(rows), tuple(other)


def write(layer: Any, k: torch.Tensor, v: torch.Tensor, block: BlockState) -> tuple[torch.Tensor, ...]:
    """Stage a block (pure: the storage changes at commit); returns the view's keys, values, key positions."""
    staged = layer._grouped.prepare(k, v, block.positions)  # CacheError before anything changes
    layer._staged = GroupedWrite(staged, block)
    return staged.keys, staged.values, staged.pos


def commit(layer: Any, write: GroupedWrite) -> None:
    st, block = write.staged, write.block
    keep = None
    if layer.evicts:  # the columns some row's next query can still see (the storage decides the granularity)
        seen = block.seen_after[:, None]  # [B, 1]
        keep = lambda pos: ((pos >= 0) & layer.spec.visible(seen, pos)).any(0)  # noqa: E731
    layer._grouped.commit(st, keep)
    publish(layer, layer._grouped)


def check_select(layer: Any, index: torch.Tensor) -> None:
    """Raise (changing nothing) if the rows cannot be selected apart (HF's axis -1 groups across rows)."""
    layer._grouped._select_rows(layer._grouped.state(), index)


def select(layer: Any, index: torch.Tensor) -> None:
    layer._grouped.select(index)
    publish(layer, layer._grouped)


def prepare_crop(layer: Any, n: int) -> dict[str, Any]:
    """The state after crop(n) (CacheCropError if the storage cannot crop exactly)."""
    return layer._grouped._crop(layer._grouped.state(), n)


def commit_crop(layer: Any, state: dict[str, Any]) -> None:
    layer._grouped.load_state(state)
    publish(layer, layer._grouped)


def restore(layer: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Put back a snapshot's (already checked) tensors: ints and bools as the storage keeps them."""
    storage, state = layer._grouped, {}
    for name, current in storage.state().items():
        t = tensors["key_pos" if name == "pos" else PREFIX + name].clone().to(layer.device)
        state[name] = t if isinstance(current, torch.Tensor) else type(current)(t.item())
    storage.load_state(state)
    storage.batch = state["pos"].shape[0]
    publish(layer, storage)
