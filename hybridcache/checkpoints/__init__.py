"""hybridcache/checkpoints."""
