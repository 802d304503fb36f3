"""experiments/train."""
