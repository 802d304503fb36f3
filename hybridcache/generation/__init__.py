"""hybridcache/generation."""
