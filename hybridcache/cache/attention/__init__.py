"""hybridcache/cache/attention."""
