"""hybridcache/cache/io."""
