"""hybridcache/cache/storage."""
