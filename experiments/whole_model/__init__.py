"""experiments/whole_model."""
