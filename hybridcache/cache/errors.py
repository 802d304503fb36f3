"""Errors raised by caches. All derive from ValueError so callers can catch bad input generically."""


class CacheError(ValueError):
    """Bad input to a cache or cache layer. The call that raised it changed nothing."""


class CacheConfigError(CacheError):
    """A cache config that cannot be resolved against a model's layers."""


class CacheCropError(CacheError):
    """A crop that the layer cannot perform exactly with what it still holds."""
