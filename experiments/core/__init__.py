"""experiments/core."""
