"""hybridcache: caches for hybrid language models (attention patterns and recurrent states)."""

from hybridcache.cache import Cache, available_layers, register_cache_layer

__all__ = ["Cache", "available_layers", "register_cache_layer"]
__version__ = "0.1.0"
