"""Measurements run on their own (`python -m experiments.benchmark.standalone.<name>`), beside the benchmark job:
speculative drafts on real text, per-family decode against HF, long prefill against HF and llama.cpp, the batch-8
account, the GEMV roofline, packed weights' KL, A/B of two worktrees or of compiled ops."""
