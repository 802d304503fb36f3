"""`tova`: TOVA (Oren et al. 2024): the tokens the last query attends to most, averaged over all heads."""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.cache.core.base import tunable
from hybridcache.cache.methods.presses.common import force
from hybridcache.cache.methods.scored_eviction import ScoredSpec, register_press
from hybridcache.cache.methods.scorer import Scorer


@dataclass(frozen=True, kw_only=True)
class TovaSpec(ScoredSpec):
    schedule: str = tunable("continuous")
    per_head_positions = False
    decodes = True


class Tova(Scorer):
    """TOVA. Continuous (the paper's): the current token competes too. The other schedules (kvpress TOVAPress, also
    inside its DecodingPress): the last token is always kept."""

    needs_weights = True

    def query_rows(self) -> int:
        return 1  # the last query (each row's last real token, with left padding)

    def score(self, ctx):
        last = ctx.weights[:, :, -1, :].mean(1, keepdim=True).double()  # [B, 1, S]
        if self.spec.schedule != "continuous":
            return force(last, ctx.slot_positions() == ctx.seen[:, None, None] - 1)
        return last


TovaLayer = register_press("tova", TovaSpec, Tova, {"budget": 6})
