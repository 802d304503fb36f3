"""hybridcache/tools."""
