"""Feeding a Cache after the fact: a decode run's tokens (cache.py's reserve_decode / feed_reserved).

A decode run (accel/runs/decode_run.py) writes each step's keys and values into slots the layers reserved beyond what
they hold, and feeds the run's tokens to the cache only when it ends, as one block: the cache's bookkeeping once
per run instead of once per layer and step. Meanwhile the cache is held as an open block holds it (its lock: no
other feed or operation, from any thread), so nothing can move the reserved slots; the written slots stay invisible
until fed (an abandoned run leaves the cache as it was). The block is committed as any block is, so the cache ends
as that many one-token blocks would leave it (the positions, the token fingerprint, each layer's eviction).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.spec_checks import check_positive_int


def reserve_decode(cache: Any, tokens: int) -> list[Any] | None:
    """Hold `cache` and reserve room for `tokens` decode tokens after every layer's held slots, for a caller that
    runs up to that many steps, writing each token's keys and values into the slots itself: per layer its buffers
    and held slots (attention_slots.Reserved). None (the cache not held) where some layer cannot (what every layer
    holds is unchanged either way)."""
    check_positive_int("Cache.reserve_decode", "tokens", tokens)
    cache._acquire("reserve_decode")
    try:
        got = [getattr(layer, "reserve_slots", lambda n: None)(tokens) for layer in cache.layers]
    except BaseException:
        cache._release()
        raise
    if any(g is None for g in got):
        cache._release()
        return None
    cache._reserved = tokens
    return got


def feed_reserved(cache: Any, ids: torch.Tensor | None) -> None:
    """End a `reserve_decode`: feed `ids` [B, n] (1 <= n <= the tokens reserved: the tokens whose keys and values the
    caller wrote into the first n reserved slots of every layer; their positions are each row's next n) as one
    all-real block, committed in every layer; or, with None, feed nothing. Either way the cache is free again; a
    failure drops the block (the layers keep what they held). Refused, changing nothing, from a thread that holds
    no reservation of this cache, or for ids that do not fit it."""
    reserved = cache._reserved
    if reserved is None or cache._holder != threading.get_ident():
        raise CacheError("feed_reserved: this thread holds no reserve_decode of this cache")
    if ids is not None and not (
        isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == cache.batch_size
        and 0 < ids.shape[1] <= reserved and not ids.is_floating_point()
    ):  # fmt: skip
        raise CacheError(
            f"feed_reserved: ids must be [{cache.batch_size}, n] token ids with 1 <= n <= {reserved} (the slots "
            f"reserved), got {tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}"
        )
    cache._reserved = None
    try:
        if ids is not None:
            _feed(cache, ids)
    finally:
        for layer in cache.layers:  # (a recurrent layer lets go of its run's state buffers)
            getattr(layer, "end_reservation", _nothing)()
        cache._release()


def _nothing() -> None:
    return None


def _feed(cache: Any, ids: torch.Tensor) -> None:
    """ids [B, n] as one block whose slots every layer takes as written (decode_block), committed."""
    seq, layers = cache.seq, cache.layers
    block = seq.make_block(None, ids.shape[1], "Cache", check=False, ids=ids)
    for layer in layers:
        layer.check_block(block)
    seq.block = block
    try:
        if any(getattr(layer, "decode_block", lambda: None)() is None for layer in layers):
            raise CacheError("feed_reserved: a layer no longer takes the slots written for it")
        for layer in layers:
            layer.commit_block()
        seq.commit()
    except BaseException:
        for layer in layers:
            layer.abort_block()
        seq.block = None
        raise
