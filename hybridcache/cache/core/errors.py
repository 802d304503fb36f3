"""Errors raised by caches. All derive from ValueError so callers can catch bad input generically."""


class CacheError(ValueError):
    """Bad input to a cache or cache layer. The call that raised it changed nothing."""


class CacheConfigError(CacheError):
    """A cache config that cannot be resolved against a model's layers."""


class CacheCropError(CacheError):
    """A crop that the layer cannot perform exactly with what it still holds."""


class CacheThreadError(CacheError):
    """A cache used from a thread that does not hold it: another thread's open block or operation."""


class CacheIndexError(CacheError, IndexError):
    """`cache[i]` with i outside the cache's layers."""


class CacheIndexTypeError(CacheError, TypeError):
    """`cache[key]` with a key that is neither an int nor a slice."""


class CacheMemoryError(CacheError, MemoryError):
    """Refused before allocating: the memory an operation would need exceeds what its device has available
    (a batch-growing cache operation, or a generation / beam search sized by its cache)."""
