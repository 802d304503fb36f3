"""`tova`: TOVA eviction (Oren et al. 2024). Full causal attention, but a row keeps at most `budget` tokens: after
each block, the ones the block's last query attended to most (weights averaged over heads).

The first cache type whose pattern depends on attention scores: the layer asks for the block's attention weights
(`wants_attention_weights`), the mixer hands them over in `observe_attention`, and eviction picks slots per row.
Lossy once a row has seen more than `budget` tokens, exact before. Dynamic storage only.
"""

from dataclasses import dataclass

import torch

from hybridcache.cache.attention import AttentionCacheLayer
from hybridcache.cache.attention_specs import AttentionSpec
from hybridcache.cache.base import check_positive_int, tunable
from hybridcache.cache.errors import CacheError
from hybridcache.cache.registry import register_cache_layer


@dataclass(frozen=True, kw_only=True)
class TovaSpec(AttentionSpec):
    budget: int = tunable()  # tokens kept per row

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("TovaSpec", "budget", self.budget)
        if self.max_length is not None:
            raise CacheError("TovaSpec: tova picks slots by attention score and needs dynamic storage (no max_length)")

    def needed_tokens(self, seen):
        return seen.clamp(max=self.budget) if isinstance(seen, torch.Tensor) else min(seen, self.budget)

    def lossless_tokens(self) -> int:
        """Rows that have seen at most this many tokens lost nothing."""
        return self.budget


@register_cache_layer("tova")
class TovaLayer(AttentionCacheLayer):
    """Keeps the `budget` tokens the last query attends to most."""

    spec_cls = TovaSpec
    exact = False
    wants_attention_weights = True
    supports_preallocation = False
    example_params = {"budget": 6}

    def observe_attention(self, weights: torch.Tensor) -> None:
        """weights [B, Hq, T, S] of the open block over the keys `update` returned."""
        if self._staged is None:
            raise CacheError(f"{self.name}: observe_attention needs the block's update first")
        self._last_scores = weights[:, :, -1, :].mean(1)  # [B, S]

    def _evict(self, pos: torch.Tensor, seen: torch.Tensor):
        scores = getattr(self, "_last_scores", None)
        self._last_scores = None
        if pos.shape[1] <= self.spec.budget:
            return None
        if scores is None or scores.shape != pos.shape:
            raise CacheError(f"{self.name}: the mixer did not hand over the block's attention weights")
        # padding and empty slots first out; ties broken towards the most recent token
        ranked = torch.where(pos >= 0, scores, float("-inf")) + pos.clamp(min=0) * 1e-12
        keep = ranked.topk(self.spec.budget, dim=1).indices  # [B, budget]
        return keep.gather(1, pos.gather(1, keep).argsort(1))  # in position order
