"""`h2o`: H2O (Zhang et al. 2023): heavy hitters by accumulated attention plus a window of recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.core.base import tunable
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.methods.presses.common import attention_sums, force
from hybridcache.cache.methods.scored_eviction import ScoredSpec, register_press
from hybridcache.cache.methods.scorer import Scorer


@dataclass(frozen=True, kw_only=True)
class H2OSpec(ScoredSpec):
    schedule: str = tunable("continuous")
    recent: int | None = tunable(None)  # most recent tokens always kept (None: half the budget, H2O's default)

    def __post_init__(self):
        super().__post_init__()
        if self.recent is not None and (
            isinstance(self.recent, bool) or not isinstance(self.recent, int) or self.recent < 0
        ):
            raise CacheError(f"H2OSpec: recent must be a non-negative integer, got {self.recent!r}")

    def recent_tokens(self, kept: int) -> int:
        return self.recent if self.recent is not None else kept // 2


class H2O(Scorer):
    """The attention each token received, per kv head, summed over every query so far and averaged over the group
    (`h2o_acc`, carried along the slots); the `recent` most recent tokens always kept."""

    needs_weights = True
    slot_state = ("h2o_acc",)  # [B, Hkv, S] float64

    def observe(self, ctx):
        sums, _ = attention_sums(ctx)
        return {"h2o_acc": ctx.state["h2o_acc"] + ctx.grouped(sums).double()}

    def score(self, ctx):
        kept = self.spec.kept_of(ctx.seen).tolist()
        recent = torch.tensor([self.spec.recent_tokens(int(k)) for k in kept], device=ctx.seen.device)
        return force(ctx.state["h2o_acc"], ctx.slot_positions() >= (ctx.seen - recent)[:, None, None])


H2OLayer = register_press("h2o", H2OSpec, H2O, {"budget": 6})
