"""`sink`: StreamingLLM's attention sinks. The first `sinks` tokens of a row stay visible, plus a sliding window.

Written as a plugin would be: one spec (the pattern and its compact static layout) and one registered class.
"""

from dataclasses import dataclass

import torch

from hybridcache.cache.attention.layer import AttentionCacheLayer
from hybridcache.cache.attention.specs import AttentionSpec, check_spare
from hybridcache.cache.core.base import check_positive_int, tunable
from hybridcache.cache.core.registry import register_cache_layer


@dataclass(frozen=True, kw_only=True)
class SinkSpec(AttentionSpec):
    window: int = tunable()  # visible recent tokens, the current one included
    sinks: int = tunable(4)
    spare: int = tunable(0)  # as SlidingSpec's: tokens kept so a crop of up to `spare` stays exact

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("SinkSpec", "window", self.window)
        check_positive_int("SinkSpec", "sinks", self.sinks)
        check_spare(self)

    @property
    def rollback(self) -> int:
        return self.spare

    def visible(self, q, kv):
        return (kv <= q) & ((kv < self.sinks) | (kv > q - self.window))

    def needed_tokens(self, seen):
        limit = self.sinks + self.window - 1
        return seen.clamp(max=limit) if isinstance(seen, torch.Tensor) else min(seen, limit)

    @property
    def ring_size(self):  # preallocated: `sinks` fixed slots, then a ring of `window` slots
        return self.sinks + self.window

    def slot_of(self, pos):
        return torch.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % self.window)

    def stays_in_slots(self, pos, seen):
        return (pos >= 0) & ((pos < self.sinks) | (pos >= seen - self.window))


@register_cache_layer("sink")
class AttentionSinkLayer(AttentionCacheLayer):
    """Attention sinks + sliding window: keeps sinks + W-1 tokens (dynamic) or sinks + a ring of W slots."""

    spec_cls = SinkSpec
    example_params = {"window": 4, "sinks": 2}  # what the conformance kit uses
