"""`knorm`: kvpress KnormPress (Devoto et al. 2024): keys with a small L2 norm are kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.methods.scored_eviction import ScoredSpec, register_press
from hybridcache.cache.methods.scorer import Scorer


@dataclass(frozen=True, kw_only=True)
class KnormSpec(ScoredSpec):
    decodes = True


class Knorm(Scorer):
    """kvpress KnormPress: -||k||_2 (computed in at least float32)."""

    def score(self, ctx):
        return -torch.linalg.vector_norm(ctx.keys, dim=-1, dtype=torch.promote_types(ctx.keys.dtype, torch.float32))


KnormLayer = register_press("knorm", KnormSpec, Knorm, {"compression_ratio": 0.4})
