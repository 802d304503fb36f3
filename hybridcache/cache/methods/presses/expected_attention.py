"""`expected_attention`: kvpress ExpectedAttentionPress (Devoto et al. 2025): the attention that future queries are
expected to pay, from the prompt's query statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.core.base import check_positive_int, tunable
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.methods.presses.common import block_queries, force
from hybridcache.cache.methods.scored_eviction import ScoredSpec, register_press
from hybridcache.cache.methods.scorer import Scorer


@dataclass(frozen=True, kw_only=True)
class ExpectedAttentionSpec(ScoredSpec):
    n_future_positions: int = tunable(512)
    n_sink: int = tunable(4)
    use_covariance: bool = tunable(True)
    use_vnorm: bool = tunable(True)
    epsilon: float = tunable(0.0)

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("ExpectedAttentionSpec", "n_future_positions", self.n_future_positions)
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise CacheError(f"ExpectedAttentionSpec: n_sink must be a non-negative integer, got {self.n_sink!r}")
        for name in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, name), bool):
                raise CacheError(f"ExpectedAttentionSpec: {name} must be a boolean, got {getattr(self, name)!r}")


class ExpectedAttention(Scorer):
    """kvpress ExpectedAttentionPress: softmax of the logits expected from the pre-rotary queries' mean and covariance
    (rotated by the mean rotary matrix of the next `n_future_positions`), times ||v||; the `n_sink` first kept."""

    needs_queries = True

    def score(self, ctx):
        s, qi = self.spec, ctx.queries
        q = qi.prerope.double()  # [B, Hq, T, D]
        stats = (block_queries(ctx, None) & (ctx.query_positions >= s.n_sink))[:, None, :, None]  # [B, 1, T, 1]
        n = stats.sum(2, keepdim=True).clamp(min=1)
        mu = (q * stats).sum(2, keepdim=True) / n  # [B, Hq, 1, D]
        centered = (q - mu) * stats
        cov = centered.transpose(-1, -2) @ centered / n  # [B, Hq, D, D]
        if qi.mean_rotation is not None:  # the mean rotary matrix of each row's next n_future_positions
            rot = torch.stack(
                [
                    qi.mean_rotation(torch.arange(int(seen), int(seen) + s.n_future_positions))
                    for seen in ctx.seen.tolist()
                ]
            ).double()[:, None]  # [B, 1, D, D]
            mu, cov = mu @ rot.transpose(-1, -2), rot @ cov @ rot.transpose(-1, -2)
        heads = q.shape[1] // ctx.keys.shape[1]
        keys = ctx.keys.double().repeat_interleave(heads, 1)  # [B, Hq, S, D]
        logits = (keys @ mu.transpose(-1, -2)).squeeze(-1) * qi.scale  # [B, Hq, S]
        if s.use_covariance:
            logits = logits + ((keys @ cov) * keys).sum(-1) * qi.scale**2 / 2
        pos = ctx.slot_positions()
        sink = pos < s.n_sink
        scored = (pos >= 0) & ~sink  # softmax over the non-sink tokens (kvpress slices the sinks off)
        logits = logits.masked_fill(~scored.repeat_interleave(q.shape[1] // pos.shape[1], 1), float("-inf"))
        scores = ctx.grouped(torch.softmax(logits, -1).nan_to_num(0.0))  # [B, Hkv, S]
        if s.use_vnorm:
            scores = (scores + s.epsilon) * ctx.values.double().norm(dim=-1)
        return force(scores, sink)


ExpectedAttentionLayer = register_press(
    "expected_attention",
    ExpectedAttentionSpec,
    ExpectedAttention,
    {"compression_ratio": 0.4, "n_sink": 1, "n_future_positions": 8},
)
