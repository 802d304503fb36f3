"""hybridcache/blocks/attention."""
