"""experiments/benchmark."""
