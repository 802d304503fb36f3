"""The Cache: one cache layer object per model layer, drawn from a registry of types.

Attention types: full, sliding (window), chunked (chunk_size); recurrent types: mamba, mamba2, rglru, conv.
"""

from hybridcache.cache.attention import (
    AttentionCacheLayer,
    AttentionView,
    ChunkedAttentionLayer,
    FullAttentionLayer,
    SlidingWindowLayer,
)
from hybridcache.cache.attention_specs import AttentionSpec, ChunkedSpec, FullSpec, SlidingSpec
from hybridcache.cache.base import CacheLayer, LayerSnapshot, LayerSpec, tunable
from hybridcache.cache.cache import Cache, CacheSnapshot
from hybridcache.cache.errors import CacheConfigError, CacheCropError, CacheError
from hybridcache.cache.plan import CachePlan, LayerPlan, NativeLayer, resolve_plan
from hybridcache.cache.recurrent import (
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
from hybridcache.cache.registry import available_layers, get_layer_class, register_cache_layer

__all__ = [
    "AttentionCacheLayer", "AttentionSpec", "AttentionView", "Cache", "CacheConfigError", "CacheCropError",
    "CacheError", "CacheLayer", "CachePlan", "CacheSnapshot", "ChunkedAttentionLayer", "ChunkedSpec", "ConvSpec",
    "ConvStateLayer", "FullAttentionLayer", "FullSpec", "LayerPlan", "LayerSnapshot", "LayerSpec", "Mamba2Spec",
    "Mamba2StateLayer", "MambaSpec", "MambaStateLayer", "NativeLayer", "RGLRUSpec", "RGLRUStateLayer",
    "RecurrentCacheLayer", "RecurrentSpec", "SlidingSpec", "SlidingWindowLayer", "available_layers",
    "get_layer_class", "register_cache_layer", "resolve_plan", "tunable",
]
