"""hybridcache/blocks/recurrent."""
