"""hybridcache/generation/sources."""
