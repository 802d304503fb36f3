"""experiments/correctness."""
