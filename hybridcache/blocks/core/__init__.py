"""hybridcache/blocks/core."""
