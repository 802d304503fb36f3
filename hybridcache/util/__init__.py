"""hybridcache/util."""
