"""`streaming_llm`: kvpress StreamingLLMPress: keep the first `n_sink` tokens and the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.cache.core.base import check_positive_int, tunable
from hybridcache.cache.methods.presses.common import force
from hybridcache.cache.methods.scored_eviction import ScoredSpec, register_press
from hybridcache.cache.methods.scorer import Scorer


@dataclass(frozen=True, kw_only=True)
class StreamingLLMSpec(ScoredSpec):
    n_sink: int = tunable(4)
    per_head_positions = False
    decodes = True

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("StreamingLLMSpec", "n_sink", self.n_sink)


class StreamingLLM(Scorer):
    """kvpress StreamingLLMPress: keep the sinks and the most recent tokens."""

    def score(self, ctx):
        pos = ctx.slot_positions().double()
        return force(pos, pos < self.spec.n_sink)


StreamingLLMLayer = register_press("streaming_llm", StreamingLLMSpec, StreamingLLM, {"budget": 5, "n_sink": 2})
