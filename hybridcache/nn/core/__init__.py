"""Shared modules: norms, linear projections, MLPs, hyper-connections, per-layer embeddings, sandwich layers."""
