"""Errors of the HF bridge. ValueError subclasses (through hybridcache.cache's), each with a one-line message."""

from hybridcache.cache.core.errors import CacheConfigError, CacheError


class BridgeError(CacheError):
    """The bridge cannot serve this model or call: an unsupported layer layout, a forward it did not see, a
    cache used with another model."""


class BridgeConfigError(BridgeError, CacheConfigError):
    """A cache config that cannot be applied to this HF model (a `layers:` index that holds no cache, ...)."""
