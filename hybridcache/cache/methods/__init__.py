"""hybridcache/cache/methods."""
