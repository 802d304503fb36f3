"""Mixture-of-experts MLPs: top-k routing, shared experts, per-family routers."""
