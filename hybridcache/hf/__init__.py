"""hybridcache inside HF transformers' own models: `cache_for(model, cache_config)` returns a `transformers.Cache`
whose layers are hybridcache cache layers (docs/hf_bridge.md).

    from hybridcache.hf import cache_for
    cache = cache_for(model, {"attention": {"type": "sliding", "window": 256}})
    out = model.generate(ids, cache=cache, max_new_tokens=32)
"""

from hybridcache.hf.bridge_cache import BridgeCache
from hybridcache.hf.build import cache_for, layout_of, plan_for
from hybridcache.hf.errors import BridgeConfigError, BridgeError
from hybridcache.hf.installer import install, uninstall

__all__ = [
    "BridgeCache",
    "BridgeConfigError",
    "BridgeError",
    "cache_for",
    "install",
    "layout_of",
    "plan_for",
    "uninstall",
]
