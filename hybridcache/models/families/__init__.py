"""hybridcache/models/families."""
