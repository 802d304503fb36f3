"""The Cache: per decoder layer one cache layer (or a group of them) drawn from a registry of types.

Attention types: full, sliding (window), chunked (chunk_size), sink (sinks + window), tova (score-based eviction to
a budget), the presses (methods/presses/); any of them stores tokens with a codec (`storage`: dense, int8, int4
(`q_group_size`), offload (dense on a slower tier), ...), optionally with a `residual` window of unquantized recent
tokens. Recurrent types: mamba, mamba2, rglru, conv, gated_delta, linear_attention. Compressed: compressed_kv (a
compressor's pooled entries and open window, DeepSeek-V4).
"""

from hybridcache.cache.attention.layer import (
    AttentionCacheLayer,
    AttentionView,
    ChunkedAttentionLayer,
    FullAttentionLayer,
    SlidingWindowLayer,
)
from hybridcache.cache.attention.specs import AttentionSpec, ChunkedSpec, FullSpec, SlidingSpec
from hybridcache.cache.core.base import CacheLayer, LayerSnapshot, LayerSpec, tunable
from hybridcache.cache.core.cache import Cache, CacheGroup, CacheSnapshot
from hybridcache.cache.core.errors import CacheConfigError, CacheCropError, CacheError
from hybridcache.cache.core.plan import CachePlan, LayerPlan, NativeGroup, NativeLayer, resolve_plan
from hybridcache.cache.core.registry import available_layers, get_layer_class, load_plugins, register_cache_layer
from hybridcache.cache.core.sequence import BlockState, SequenceState
from hybridcache.cache.recurrent.layers import (
    ConvSpec,
    ConvStateLayer,
    Mamba2Spec,
    Mamba2StateLayer,
    MambaSpec,
    MambaStateLayer,
    RecurrentCacheLayer,
    RecurrentSpec,
    RGLRUSpec,
    RGLRUStateLayer,
)
from hybridcache.cache.storage.codecs import DenseCodec, KVCodec, available_codecs, get_codec, register_kv_codec

# Built-in extensions, written exactly as a user's plugin module would be (one file each).
from hybridcache.cache.recurrent import delta_rule  # noqa: E402,F401  isort: skip
from hybridcache.cache.recurrent import linear_attention  # noqa: E402,F401  isort: skip
from hybridcache.cache.storage import grouped_codecs, int4, int8, offload  # noqa: E402,F401  isort: skip
from hybridcache.cache.methods import presses  # noqa: E402,F401  isort: skip
from hybridcache.cache.attention import sink  # noqa: E402,F401  isort: skip
from hybridcache.cache import compressed  # noqa: E402,F401  isort: skip

__all__ = [
    "AttentionCacheLayer",
    "AttentionSpec",
    "AttentionView",
    "BlockState",
    "Cache",
    "CacheConfigError",
    "CacheCropError",
    "CacheError",
    "CacheGroup",
    "CacheLayer",
    "CachePlan",
    "CacheSnapshot",
    "ChunkedAttentionLayer",
    "ChunkedSpec",
    "ConvSpec",
    "ConvStateLayer",
    "DenseCodec",
    "FullAttentionLayer",
    "FullSpec",
    "KVCodec",
    "LayerPlan",
    "LayerSnapshot",
    "LayerSpec",
    "Mamba2Spec",
    "Mamba2StateLayer",
    "MambaSpec",
    "MambaStateLayer",
    "NativeGroup",
    "NativeLayer",
    "RGLRUSpec",
    "RGLRUStateLayer",
    "RecurrentCacheLayer",
    "RecurrentSpec",
    "SequenceState",
    "SlidingSpec",
    "SlidingWindowLayer",
    "available_codecs",
    "available_layers",
    "get_codec",
    "get_layer_class",
    "load_plugins",
    "register_cache_layer",
    "register_kv_codec",
    "resolve_plan",
    "tunable",
]
