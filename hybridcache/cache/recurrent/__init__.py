"""hybridcache/cache/recurrent."""
