"""A score-based method's heart: one small `Scorer` object whose `score(ctx)` ranks the slots a block's view holds.

The layer (scored_eviction.py: targets, modes, per-head storage, which tokens go) is the same for every method; a
method is its spec (parameters) and its scorer. Methods that carry something along the slots from block to block
(H2O's accumulated attention) name it in `slot_state`: the layer keeps those tensors next to the slots (zeros for
each block's new tokens, the kept slots' entries after an eviction, rows with the batch, saved with the cache) and
hands them over in `ctx.state`; `observe(ctx)` returns their new values before `score(ctx)` reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass
class QueryInputs:
    """What a method that models future queries needs (ExpectedAttention): the block's queries before rotary."""

    prerope: torch.Tensor  # [B, Hq, T, D], after any q-norm, before rotary
    mean_rotation: Callable[[torch.Tensor], torch.Tensor] | None  # positions [N] -> mean rotary matrix [D, D]
    scale: float  # the softmax scale of q . k


@dataclass
class ScoreContext:
    """Everything a score sees at the end of a block: the view's slots and what the mixer handed over."""

    keys: torch.Tensor  # [B, Hkv, S, D] the view's keys (rotary applied), decoded
    values: torch.Tensor  # [B, Hkv, S, D]
    positions: torch.Tensor  # [B, S] or [B, Hkv, S]: the slots' positions, -1 empty
    query_positions: torch.Tensor  # [B, T] the block's, -1 padding (the last T of them: `Scorer.query_rows`)
    seen: torch.Tensor  # [B] real tokens per row after the block
    weights: torch.Tensor | None  # [B, Hq, T, S] the block's attention weights over the slots (its last T queries)
    queries: QueryInputs | None
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # the scorer's slot_state [B, (Hs,) S]

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hq, ...] -> [B, Hkv, ...]: the mean over each kv head's group of query heads."""
        hkv = self.keys.shape[1]
        return x.unflatten(1, (hkv, x.shape[1] // hkv)).mean(2)

    def slot_positions(self) -> torch.Tensor:
        """[B, Hs, S] with Hs = 1 for shared positions."""
        return self.positions if self.positions.dim() == 3 else self.positions[:, None]


class Scorer:
    """Scores [B, Hs, S] (float; higher is kept) over a block's view; Hs = the kv heads, or 1 for shared positions.

    `needs_weights`: `ctx.weights` (the block's attention weights) must be there; `needs_queries`: `ctx.queries`.
    """

    needs_weights: ClassVar[bool] = False
    needs_queries: ClassVar[bool] = False
    slot_state: ClassVar[tuple[str, ...]] = ()  # running per-slot tensors [B, (Hs,) S] float64, by saved name

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        raise NotImplementedError

    def query_rows(self) -> int | None:
        """How many of the block's last queries `score` reads the attention weights of (None: all of them). The
        layer keeps only those rows between the attention call and the block's end (and `ctx.query_positions`
        then holds their positions): with every layer's weights [B, Hq, T, S] held until then, a long prompt's
        peak memory is theirs."""
        return None

    def observe(self, ctx: ScoreContext) -> dict[str, torch.Tensor]:
        """New values of the `slot_state` tensors after this block (ctx.state holds the current ones)."""
        return {}

    def targets(self, candidates: torch.Tensor) -> torch.Tensor | None:
        """Tokens each row (and head) keeps of its candidates [B, Hs] (None: the spec's count)."""
        return None
