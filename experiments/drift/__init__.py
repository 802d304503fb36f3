"""experiments/drift."""
