"""experiments/press_check."""
