"""Score-based KV compression methods, named and computed as kvpress's presses (NVIDIA kvpress 0.5.5), plus H2O.

Each is one file: a spec (its parameters) and a `Scorer` (scorer.py: `score(ctx)`, optional per-slot state), registered
under its config name as the one score-based layer type (`ScoredEvictionLayer`, scored_eviction.py: targets, schedules,
per-head storage). Defaults are the published ones; `schedule` defaults to the method's published semantics (kvpress's
presses compress the prompt once: `prefill`; TOVA and H2O evict while decoding: `continuous`). knorm, tova and
streaming_llm also take kvpress's decoding-time schedules `decoding` / `prefill_decoding` (DecodingPress /
PrefillDecodingPress, press_schedule.py).

| type | score (higher is kept) | heads |
|---|---|---|
| streaming_llm | the first `n_sink` tokens, then the most recent | shared |
| knorm | -||k||_2 | per kv head |
| snapkv | attention of the last `window_size` queries, averaged, avg-pooled over `kernel_size` slots, averaged over the group; the window itself always kept | per kv head |
| pyramidkv | snapkv's, with per-layer budgets shrinking linearly with depth (`beta`) | per kv head |
| tova | the last query's attention averaged over all heads (prefill: the last token always kept) | shared |
| observed_attention | attention a token received, summed over the queries that see it / their number | per kv head |
| expected_attention | softmax of the attention expected from the prompt's query statistics (mean and covariance of the pre-rotary queries, rotated by the mean rotary matrix of the next `n_future_positions`), times ||v||; `n_sink` first tokens kept | per kv head |
| h2o | attention accumulated over every query so far (heavy hitters), plus the `recent` most recent tokens always kept | per kv head |
"""

from hybridcache.cache.methods.presses.common import KEEP, attention_sums, block_queries, force
from hybridcache.cache.methods.presses.expected_attention import (
    ExpectedAttention,
    ExpectedAttentionLayer,
    ExpectedAttentionSpec,
)
from hybridcache.cache.methods.presses.h2o import H2O, H2OLayer, H2OSpec
from hybridcache.cache.methods.presses.knorm import Knorm, KnormLayer, KnormSpec
from hybridcache.cache.methods.presses.observed_attention import (
    ObservedAttention,
    ObservedAttentionLayer,
    ObservedAttentionSpec,
)
from hybridcache.cache.methods.presses.pyramidkv import PyramidKV, PyramidKVLayer, PyramidKVSpec
from hybridcache.cache.methods.presses.snapkv import SnapKV, SnapKVLayer, SnapKVSpec, snapkv_scores
from hybridcache.cache.methods.presses.streaming_llm import StreamingLLM, StreamingLLMLayer, StreamingLLMSpec
from hybridcache.cache.methods.presses.tova import Tova, TovaLayer, TovaSpec

__all__ = [
    "KEEP",
    "ExpectedAttention",
    "ExpectedAttentionLayer",
    "ExpectedAttentionSpec",
    "H2O",
    "H2OLayer",
    "H2OSpec",
    "Knorm",
    "KnormLayer",
    "KnormSpec",
    "ObservedAttention",
    "ObservedAttentionLayer",
    "ObservedAttentionSpec",
    "PyramidKV",
    "PyramidKVLayer",
    "PyramidKVSpec",
    "SnapKV",
    "SnapKVLayer",
    "SnapKVSpec",
    "StreamingLLM",
    "StreamingLLMLayer",
    "StreamingLLMSpec",
    "Tova",
    "TovaLayer",
    "TovaSpec",
    "attention_sums",
    "block_queries",
    "force",
    "snapkv_scores",
]
