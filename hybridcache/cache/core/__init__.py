"""hybridcache/cache/core."""
