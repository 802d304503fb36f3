"""hybridcache/accel/native/steps."""
