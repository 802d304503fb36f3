"""Prefix reuse across requests for hybrid models: `hc.generate(model, ids, prefix_cache=store)`.

A `PrefixStore` keeps whole-cache snapshots (attention KV and recurrent states together) keyed by the token prefix
they hold. A request starts from the longest stored prefix of its prompt (leaving at least one token to feed) and
prefills only the rest; the output equals generation without reuse. Recurrent states cannot be cut out of a longer
sequence, so *which* prefixes to keep is the policy (admission), as in Marconi (Pan et al., 2024):
- "marconi": keep (1) the state at the last block boundary a new prompt shares with an earlier request (a branch
  point: shared system prompts, few-shot headers) and (2) the state at the end of each request (prompt + output:
  the next turn of that conversation starts there). Eviction scores entries by recency plus `alpha` times the
  FLOPs they save per byte (both min-max normalised), so long, compact (recurrent-heavy) prefixes stay.
- "all": keep every block boundary of every prompt and every request end; evict least recently used.
A memory budget (`max_bytes`) bounds what is held; `stats()` reports hit rate, tokens saved and bytes held.
Requests are single rows without padding (a batch of prompts would share one cache; serve them one by one).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.cache import Cache, CacheSnapshot


@dataclass
class _Entry:
    snapshot: CacheSnapshot
    length: int  # tokens held
    nbytes: int
    flops: float  # estimated FLOPs a hit on this entry saves
    last_used: float
    hits: int = 0


def _prefix_keys(tokens: list[int]) -> list[bytes]:
    """keys[i] identifies tokens[:i + 1] (a blake2b chain: O(length) for all prefixes)."""
    h, keys = hashlib.blake2b(digest_size=16), []
    for t in tokens:
        h.update(int(t).to_bytes(8, "little", signed=True))
        keys.append(h.copy().digest())
    return keys


def snapshot_nbytes(snap: CacheSnapshot) -> int:
    return sum(t.numel() * t.element_size() for layer in snap.layers for t in layer.tensors.values())


class PrefixStore:
    """Snapshots of caches keyed by token prefixes, with an admission policy, a memory budget and eviction."""

    def __init__(
        self,
        block_size: int = 16,
        max_bytes: int = 256 << 20,
        policy: str = "marconi",
        alpha: float = 1.0,
        max_paths: int = 100_000,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        if policy not in ("marconi", "all"):
            raise ValueError(f"policy must be 'marconi' or 'all', got {policy!r}")
        self.block_size, self.max_bytes, self.policy, self.alpha = block_size, max_bytes, policy, float(alpha)
        self.entries: dict[bytes, _Entry] = {}
        self.paths: OrderedDict[bytes, None] = OrderedDict()  # boundary keys of earlier prompts (no states)
        self.max_paths = max_paths
        self._owner: tuple[Any, Any] | None = None
        # Threads may share a store: each request's prepare and finish run whole under this lock (a lookup, restore
        # and admission interleaved with another thread's eviction would restore a half-replaced entry).
        self._lock = threading.RLock()
        self.counters = {
            "requests": 0,
            "hits": 0,
            "prompt_tokens": 0,
            "tokens_saved": 0,
            "admitted": 0,
            "evicted": 0,
            "rejected_too_big": 0,
        }

    # -- what generate calls -------------------------------------------------------------------------------------
    def prepare(
        self, model, input_ids: torch.Tensor, mask: torch.Tensor, cache_config: Mapping[str, Any] | None
    ) -> tuple[Cache, dict[str, Any]]:
        """A cache holding the longest stored prefix of the prompt, fed on to the admitted boundaries (at least one
        prompt token is left for generate to feed)."""
        with self._lock:
            return self._prepare(model, input_ids, mask, cache_config)

    def _prepare(
        self, model, input_ids: torch.Tensor, mask: torch.Tensor, cache_config: Mapping[str, Any] | None
    ) -> tuple[Cache, dict[str, Any]]:
        if input_ids.shape[0] != 1 or not bool(mask.all()):
            raise ValueError("prefix_cache= serves one request at a time: input_ids [1, T] without padding")
        cache = model.make_cache(1, cache_config)
        self._bind(model, cache)
        tokens = input_ids[0].tolist()
        keys = _prefix_keys(tokens)
        hit = next((n for n in range(len(tokens) - 1, 0, -1) if keys[n - 1] in self.entries), 0)
        if hit:
            entry = self.entries[keys[hit - 1]]
            entry.last_used, entry.hits = time.monotonic(), entry.hits + 1
            cache.restore(entry.snapshot)
        boundaries = list(range(self.block_size, len(tokens), self.block_size))  # < len: one token left to feed
        if self.policy == "all":
            admit = [b for b in boundaries if b > hit]
        else:  # the last boundary this prompt shares with an earlier one: a branch point
            shared = [b for b in boundaries if keys[b - 1] in self.paths]
            admit = [shared[-1]] if shared and shared[-1] > hit else []
        for b in admit:
            if keys[b - 1] not in self.entries:
                model.feed_block(input_ids[:, cache.columns : b], cache, None, last_only=True)
                self._admit(keys[b - 1], b, cache, model)
        for b in boundaries:
            self.paths[keys[b - 1]] = None
            self.paths.move_to_end(keys[b - 1])
        while len(self.paths) > self.max_paths:
            self.paths.popitem(last=False)
        self.counters["requests"] += 1
        self.counters["hits"] += bool(hit)
        self.counters["prompt_tokens"] += len(tokens)
        self.counters["tokens_saved"] += hit
        return cache, {"hit_tokens": hit, "prompt_tokens": len(tokens)}

    def finish(self, model, out, request: dict[str, Any]) -> dict[str, Any]:
        """Admit the state at the end of the request (prompt + output), then report."""
        with self._lock:
            cache = out.cache
            held = out.sequences[0, : cache.columns].tolist()
            key = _prefix_keys(held)[-1]
            if key not in self.entries:
                self._admit(key, len(held), cache, model)
            return {**request, **self.stats()}

    # -- bookkeeping -----------------------------------------------------------------------------------------------
    def _bind(self, model, cache: Cache) -> None:
        """A store serves one model and cache configuration (snapshots only fit caches with the same layers)."""
        plan = cache.plan
        if self._owner is None:
            self._owner = (model, plan)
        elif self._owner[0] is not model or self._owner[1] != plan:
            raise ValueError(
                "this PrefixStore holds caches of another model or cache configuration; use one store "
                "per model and cache_config"
            )

    def _flops(self, model, cache: Cache, length: int) -> float:
        """FLOPs a hit of `length` tokens saves: 2 * params per token plus attention scores over the prefix."""
        params = sum(p.numel() for p in model.parameters())
        attn = sum(
            2 * layer.spec.num_kv_heads * layer.spec.head_dim for layer in cache.layers if layer.kind == "attention"
        )
        return 2.0 * params * length + 2.0 * attn * length * length

    def _admit(self, key: bytes, length: int, cache: Cache, model) -> None:
        snap = cache.snapshot()
        size = snapshot_nbytes(snap)
        if size > self.max_bytes:
            self.counters["rejected_too_big"] += 1
            return
        self.entries[key] = _Entry(snap, length, size, self._flops(model, cache, length), time.monotonic())
        self.counters["admitted"] += 1
        while self.nbytes() > self.max_bytes:
            victim = self._victim(protect=key)
            del self.entries[victim]
            self.counters["evicted"] += 1

    def _victim(self, protect: bytes) -> bytes:
        candidates = [k for k in self.entries if k != protect]
        if self.policy == "all":
            return min(candidates, key=lambda k: self.entries[k].last_used)

        def norm(values: list[float]) -> list[float]:
            lo, hi = min(values), max(values)
            return [(v - lo) / (hi - lo) if hi > lo else 1.0 for v in values]

        recency = norm([self.entries[k].last_used for k in candidates])
        efficiency = norm([self.entries[k].flops / self.entries[k].nbytes for k in candidates])
        scores = [r + self.alpha * e for r, e in zip(recency, efficiency)]
        return candidates[scores.index(min(scores))]

    def nbytes(self) -> int:
        """Bytes of snapshots held."""
        with self._lock:
            return sum(e.nbytes for e in self.entries.values())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            **c,
            "hit_rate": c["hits"] / c["requests"] if c["requests"] else 0.0,
            "saved_fraction": c["tokens_saved"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            "entries": len(self.entries),
            "bytes_held": self.nbytes(),
            "max_bytes": self.max_bytes,
        }
