"""`observed_attention`: kvpress ObservedAttentionPress: the mean attention a token received from the queries that
saw it (H2O's score during the prefill)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.cache.methods.presses.common import attention_sums
from hybridcache.cache.methods.scored_eviction import ScoredSpec, register_press
from hybridcache.cache.methods.scorer import Scorer


@dataclass(frozen=True, kw_only=True)
class ObservedAttentionSpec(ScoredSpec):
    pass


class ObservedAttention(Scorer):
    """kvpress ObservedAttentionPress."""

    needs_weights = True

    def score(self, ctx):
        sums, counts = attention_sums(ctx)
        heads = sums.shape[1] // counts.shape[1]
        return ctx.grouped(sums / counts.clamp(min=1).repeat_interleave(heads, 1)).double()


ObservedAttentionLayer = register_press(
    "observed_attention", ObservedAttentionSpec, ObservedAttention, {"compression_ratio": 0.4}
)
