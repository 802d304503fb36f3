"""hybridcache/blocks/fast."""
