"""WHEN a score-based method evicts and HOW MANY tokens a row keeps: the schedules of scored_eviction.py and kvpress's
counts, as plain functions of token counts (no tensors of keys, no layer state).

- `prefill`: the prompt (the first block a layer sees) compressed by `compression_ratio` (or to `budget`); every
  later block kept whole (kvpress's presses).
- `continuous`: every block, the prompt included, evicted to `budget` (TOVA's and H2O's decoding-time form).
- `decoding`: the prompt kept whole; every later block counted, and at the `compression_interval`-th since the last
  compression (or at a block of at least `budget` tokens) everything held is compressed to `budget` (kvpress's
  `DecodingPress`).
- `prefill_decoding`: the prompt compressed by `compression_ratio`, then as `decoding` (kvpress's
  `PrefillDecodingPress` with the same method in both phases).

docs/presses_decoding.md has kvpress 0.5.5's code path behind the two decoding schedules.
"""

from __future__ import annotations

import torch

SCHEDULES = ("prefill", "continuous", "decoding", "prefill_decoding")
DECODING_SCHEDULES = ("decoding", "prefill_decoding")  # kvpress's DecodingPress runs after the prompt
DEFAULT_INTERVAL = 512  # kvpress DecodingPress.compression_interval's default


def ratio_kept(tokens, compression_ratio: float):
    """kvpress compute_n_kept: max(1, int(L (1 - r))) of L > 0 tokens (0 stays 0); int or tensor."""
    keep = 1 - compression_ratio
    if isinstance(tokens, torch.Tensor):
        return torch.where(tokens > 0, (tokens.double() * keep).long().clamp(min=1), tokens)
    return max(1, int(tokens * keep)) if tokens > 0 else 0


def _kvpress_target_ratio(k_len: int, target: int) -> float:
    """kvpress 0.5.5 DecodingPress._find_target_compression_ratio, transcribed: the ratio whose int() rounding keeps
    `target` of `k_len`, by 20 bisection steps from 1 - target / k_len (float64, as Python computes it there)."""
    if k_len <= target:
        return 0.0
    ratio, low, high = 1.0 - target / k_len, 0.0, 1.0
    for _ in range(20):
        n_kept = int(k_len * (1 - ratio))
        if n_kept == target:
            break
        if n_kept > target:
            low, ratio = ratio, (ratio + high) / 2
        else:
            high, ratio = ratio, (low + ratio) / 2
    return ratio


def decoding_kept_count(k_len: int, budget: int) -> int:
    """Tokens kvpress's DecodingPress keeps of `k_len` with target_size `budget`: all of them when k_len <= budget
    (ratio 0: ScorerPress leaves the cache alone), else compute_n_kept at the bisected ratio. That is `budget`
    exactly except where the bisection misses (k_len around a million and more: budget + 1, as kvpress keeps)."""
    if k_len <= budget:
        return k_len
    return ratio_kept(k_len, _kvpress_target_ratio(k_len, budget))


def decoding_kept(tokens, budget: int):
    """decoding_kept_count over an int or a tensor of counts (any shape)."""
    if isinstance(tokens, torch.Tensor):
        counts = [decoding_kept_count(int(t), budget) for t in tokens.flatten().tolist()]
        return torch.tensor(counts, dtype=torch.long, device=tokens.device).view(tokens.shape)
    return decoding_kept_count(int(tokens), budget)


def tokens_held(spec, prompt_len: int, tokens: int, peak: bool = False) -> int:
    """Tokens a row of a `spec` layer holds after a `prompt_len`-token prompt in one block and then one token per
    block up to `tokens` seen (the planner's scenario), as the row's pattern sees them; `peak`: the most it held
    between two blocks on the way (decoding schedules hold up to budget + compression_interval - 1, or the whole prompt
    and what follows it until their first compression). Exact under full attention; under a window or chunk a
    bound (kept tokens leave the window as it moves on)."""
    if not 0 < prompt_len <= tokens:
        raise ValueError(f"need 0 < prompt_len <= tokens, got prompt_len={prompt_len}, tokens={tokens}")
    schedule = spec.schedule
    if schedule == "continuous":
        return int(spec.kept_of(spec.pattern_needed(tokens)))
    held = int(spec.pattern_needed(prompt_len))
    if schedule != "decoding":
        held = int(spec.prompt_kept(held))
    if schedule == "prefill":  # the pattern's own eviction only after the prompt: grows, or stays at the window
        return min(int(spec.pattern_needed(tokens)), held + tokens - prompt_len)
    most, steps = held, 0
    for seen in range(prompt_len + 1, tokens + 1):  # kvpress: count the block, compress at the interval-th
        held = min(int(spec.pattern_needed(seen)), held + 1)
        steps += 1
        if steps >= spec.interval or spec.budget <= 1:
            held, steps = decoding_kept_count(held, spec.budget), 0
        most = max(most, held)
    return most if peak else held
