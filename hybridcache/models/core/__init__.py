"""hybridcache/models/core."""
