"""What several scorers share: the score of a token that is always kept, and sums of the block's attention."""

from __future__ import annotations

import torch

from hybridcache.cache.methods.scorer import ScoreContext

KEEP = float("inf")  # the score of a token a method always keeps (kvpress: max + 1)


def force(scores: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Scores with the tokens `where` is True always kept."""
    return torch.where(where, torch.full_like(scores, KEEP), scores)


def block_queries(ctx: ScoreContext, last: int | None) -> torch.Tensor:
    """[B, T] which of the block's queries count: the real ones, or only each row's `last` most recent."""
    q = ctx.query_positions
    real = q >= 0
    return real if last is None else real & (q >= ctx.seen[:, None] - last)


def attention_sums(ctx: ScoreContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention each slot received, summed over the block's real queries [B, Hq, S], and how many of them
    could see it [B, Hs, S]."""
    real = block_queries(ctx, None)
    sums = (ctx.weights * real[:, None, :, None]).sum(2)
    q, pos = ctx.query_positions[:, None, :, None], ctx.slot_positions()[:, :, None, :]  # [B, 1, T, 1], [B, Hs, 1, S]
    seeing = (q >= 0) & (pos >= 0) & (pos <= q)
    return sums, seeing.sum(2)
