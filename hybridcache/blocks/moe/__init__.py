"""hybridcache/blocks/moe."""
