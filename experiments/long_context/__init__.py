"""experiments/long_context."""
