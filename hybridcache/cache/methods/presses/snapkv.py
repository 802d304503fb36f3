"""`snapkv`: kvpress SnapKVPress (Li et al. 2024): the attention of the prompt's last `window_size` queries, pooled."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridcache.cache.core.base import check_positive_int, tunable
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.methods.presses.common import block_queries, force
from hybridcache.cache.methods.scored_eviction import ScoredSpec, register_press
from hybridcache.cache.methods.scorer import ScoreContext, Scorer


@dataclass(frozen=True, kw_only=True)
class SnapKVSpec(ScoredSpec):
    window_size: int = tunable(64)
    kernel_size: int = tunable(5)

    def __post_init__(self):
        super().__post_init__()
        check_positive_int(type(self).__name__, "window_size", self.window_size)
        check_positive_int(type(self).__name__, "kernel_size", self.kernel_size)
        if self.kernel_size % 2 == 0:
            raise CacheError(
                f"{type(self).__name__}: kernel_size must be odd (pooling keeps the length), got {self.kernel_size}"
            )


def snapkv_scores(ctx: ScoreContext, window_size: int, kernel_size: int) -> torch.Tensor:
    """[B, Hkv, S]: the mean attention of each row's last `window_size` queries, pooled along the slots (zeros past
    the ends, as avg_pool1d pads), averaged over the group; the window's own tokens always kept."""
    window = block_queries(ctx, window_size)  # [B, T]
    n = window.sum(1).clamp(min=1).to(ctx.weights.dtype)
    att = (ctx.weights * window[:, None, :, None]).sum(2) / n[:, None, None]  # [B, Hq, S]
    pos = ctx.slot_positions()  # [B, Hs, S]
    in_window = pos >= ctx.seen[:, None, None] - window_size
    heads = att.shape[1] // pos.shape[1]
    att = att.masked_fill(in_window.repeat_interleave(heads, 1), 0.0)  # kvpress scores keys[:-window] only
    att = F.avg_pool1d(att, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    return force(ctx.grouped(att).double(), in_window)


class SnapKV(Scorer):
    """kvpress SnapKVPress (Li et al. 2024)."""

    needs_weights = True

    def query_rows(self) -> int:
        return self.spec.window_size  # each row's last window_size real queries: the block's last columns

    def score(self, ctx):
        return snapkv_scores(ctx, self.spec.window_size, self.spec.kernel_size)


SnapKVLayer = register_press(
    "snapkv", SnapKVSpec, SnapKV, {"compression_ratio": 0.4, "window_size": 3, "kernel_size": 3}
)
