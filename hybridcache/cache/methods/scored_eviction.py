"""Score-based KV eviction: the one layer type under the methods named after kvpress's presses (methods/presses/).

A method is a score (which tokens matter), a target (`compression_ratio`, kvpress's, or a token `budget`) and WHEN
it evicts (`schedule`; press_schedule.py has the table):
- `prefill`: once, at the end of the first block a layer is fed (the prompt), so the prompt's own queries saw every
  token; later blocks (decoding) are kept whole. This is kvpress's semantics: a forward hook after each attention
  layer compresses the prefill, and decoding is not compressed. Feed the prompt as ONE block (`generate` does).
- `continuous`: after every block, each row keeps at most `budget` tokens (TOVA's / H2O's decoding-time form).
- `decoding` / `prefill_decoding`: kvpress's DecodingPress / PrefillDecodingPress: the prompt kept whole / compressed
  by `compression_ratio`; then every `compression_interval`-th later block (or a block of at least `budget` tokens)
  compresses everything the row holds to `budget`. Offered where kvpress 0.5.5 scores the method the same way while
  decoding (`decodes`: knorm, tova, streaming_llm; docs/presses_decoding.md says why not the others).

Per kvpress, a row keeps n_kept = max(1, int(L * (1 - compression_ratio))) of its L prompt tokens, or min(L, budget)
(decoding: kvpress's bisected count, press_schedule.decoding_kept).
Scores are [B, Hs, S] over the view's slots (Hs = the kv heads for per-head methods, whose heads keep different
tokens, or 1); the top n_kept per row and head are kept, ties going to the more recent token, then ordered by
position. Storage stays rectangular: a row or head that keeps fewer tokens holds empty slots (position -1).

The pattern under the eviction is full causal attention, or a sliding window / chunk when the spec has `window` /
`chunk_size` (a natively sliding layer passes its window on), so a method works on every attention layer type.
Lossy once a row holds more than it keeps (`lossless_tokens`); dynamic storage only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from hybridcache.cache.attention.layer import AttentionCacheLayer, _per_row
from hybridcache.cache.attention.specs import AttentionSpec
from hybridcache.cache.attention.staging import BlockWrite
from hybridcache.cache.core.base import check_positive_int, tunable
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.registry import register_cache_layer
from hybridcache.cache.methods.press_schedule import (
    DECODING_SCHEDULES,
    DEFAULT_INTERVAL,
    SCHEDULES,
    decoding_kept,
    ratio_kept,
)
from hybridcache.cache.methods.scorer import QueryInputs, ScoreContext, Scorer  # noqa: F401  (re-exported)


@dataclass(frozen=True, kw_only=True)
class ScoredSpec(AttentionSpec):
    """A score-based eviction method over full attention (or a `window` / `chunk_size` pattern)."""

    compression_ratio: float | None = tunable(None)  # fraction of a prompt's tokens evicted (prefill schedules)
    budget: int | None = tunable(None)  # tokens kept per row (and head)
    schedule: str = tunable("prefill")
    compression_interval: int | None = tunable(None)  # decoding schedules: blocks between compressions (None: 512)
    window: int | None = tunable(None)  # sliding-window pattern underneath (a natively sliding layer's own)
    chunk_size: int | None = tunable(None)  # chunked pattern underneath
    per_head_positions: ClassVar[bool] = True  # False: one set of tokens for all of a row's heads
    decodes: ClassVar[bool] = False  # offers the decoding schedules (kvpress 0.5.5 scores it the same while decoding)

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        if self.max_length is not None:
            raise CacheError(
                f"{owner}: score-based eviction picks slots by score and needs dynamic storage (no max_length)"
            )
        if self.schedule not in SCHEDULES:
            raise CacheError(f"{owner}: schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        check_positive_int(owner, "budget", self.budget, allow_none=True)
        check_positive_int(owner, "window", self.window, allow_none=True)
        check_positive_int(owner, "chunk_size", self.chunk_size, allow_none=True)
        check_positive_int(owner, "compression_interval", self.compression_interval, allow_none=True)
        r = self.compression_ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1):
            raise CacheError(f"{owner}: compression_ratio must be a number in [0, 1), got {r!r}")
        if self.schedule in DECODING_SCHEDULES:
            self._check_decoding(owner)
            return
        if self.compression_interval is not None:
            raise CacheError(
                f"{owner}: compression_interval applies to schedules {' and '.join(DECODING_SCHEDULES)}, "
                f"not {self.schedule!r}"
            )
        if (r is None) == (self.budget is None):
            raise CacheError(
                f"{owner}: give exactly one of compression_ratio (the fraction of the prompt evicted) or "
                f"budget (tokens kept), got compression_ratio={r!r}, budget={self.budget!r}"
            )
        if self.schedule == "continuous" and self.budget is None:
            raise CacheError(
                f"{owner}: schedule 'continuous' evicts to a fixed budget after every block: give budget, "
                "not compression_ratio"
            )

    def _check_decoding(self, owner: str) -> None:
        if not self.decodes:
            raise CacheError(
                f"{owner}: schedule {self.schedule!r} (kvpress's DecodingPress) is offered for knorm, tova and "
                "streaming_llm only: kvpress 0.5.5 scores the other methods differently while decoding "
                "(docs/presses_decoding.md)"
            )
        if self.budget is None:
            raise CacheError(
                f"{owner}: schedule {self.schedule!r} compresses to budget tokens (kvpress's target_size) every "
                "compression_interval decoding blocks: give budget"
            )
        if self.schedule == "decoding" and self.compression_ratio is not None:
            raise CacheError(
                f"{owner}: schedule 'decoding' keeps the prompt whole (kvpress's DecodingPress); a compression_ratio "
                "for the prompt is schedule 'prefill_decoding'"
            )
        if self.schedule == "prefill_decoding" and self.compression_ratio is None:
            raise CacheError(
                f"{owner}: schedule 'prefill_decoding' compresses the prompt by compression_ratio, then decoding to "
                "budget: give both"
            )

    @property
    def interval(self) -> int:
        """Decoding blocks between two compressions (decoding schedules)."""
        return self.compression_interval or DEFAULT_INTERVAL

    @property
    def per_head(self) -> bool:
        return self.per_head_positions

    def visible(self, q, kv):
        out = kv <= q
        if self.window is not None:
            out = out & (kv > q - self.window)
        if self.chunk_size is not None:
            out = out & (torch.div(kv, self.chunk_size, rounding_mode="floor") == q // self.chunk_size)
        return out

    def pattern_needed(self, seen):
        """What the pattern underneath (full / window / chunk) still needs, before any eviction."""
        if self.window is not None:
            seen = seen.clamp(max=self.window - 1) if isinstance(seen, torch.Tensor) else min(seen, self.window - 1)
        if self.chunk_size is not None:
            seen = seen % self.chunk_size
        return seen

    def prompt_kept(self, tokens):
        """How many of `tokens` prompt candidates a row keeps (kvpress's compute_n_kept for a ratio)."""
        if self.compression_ratio is None:
            return tokens.clamp(max=self.budget) if isinstance(tokens, torch.Tensor) else min(tokens, self.budget)
        return ratio_kept(tokens, self.compression_ratio)

    def decoding_kept(self, tokens):
        """How many of `tokens` candidates a decoding compression keeps (kvpress's DecodingPress count)."""
        return decoding_kept(tokens, self.budget)

    def kept_of(self, tokens):
        """The fewest of `tokens` candidates a row keeps once it has evicted."""
        if self.schedule in ("prefill", "continuous"):
            return self.prompt_kept(tokens)
        at_most = tokens.clamp(max=self.budget) if isinstance(tokens, torch.Tensor) else min(tokens, self.budget)
        if self.schedule == "decoding":
            return at_most
        prompt = self.prompt_kept(tokens)  # prefill_decoding: the prompt's count, or the budget once decoding
        return torch.minimum(prompt, at_most) if isinstance(tokens, torch.Tensor) else min(prompt, at_most)

    def needed_tokens(self, seen):
        """As if the `seen` tokens were one prompt (prefill) or a stream (the other schedules)."""
        return self.kept_of(self.pattern_needed(seen))

    def lossless_tokens(self) -> int:
        """Rows that have seen at most this many tokens lost nothing."""
        r = self.compression_ratio
        if r is not None and r > 0:  # a prompt of two or more tokens loses some
            return 1
        return self.budget if self.budget is not None else 2**62


class ScoredEvictionLayer(AttentionCacheLayer):
    """Keeps each row's (and head's) top-scoring tokens, ranked by its `scorer_cls` (a `Scorer`; `register_press`
    makes the registered type of a spec and a scorer).

    `needs_weights`: the method reads the block's attention weights; `needs_queries`: the pre-rotary queries (the
    scorer's, by default).
    """

    scorer_cls: ClassVar[type[Scorer]] = Scorer

    spec_cls = ScoredSpec
    exact = False
    supports_preallocation = False
    own_eviction = True  # the top-scoring tokens per row and head, not what the pattern sees
    needs_weights: ClassVar[bool] = True
    needs_queries: ClassVar[bool] = False
    example_params = {"budget": 5, "schedule": "continuous"}
    spec: ScoredSpec

    def _allocate(self, batch_size: int) -> None:
        super()._allocate(batch_size)
        rows = (batch_size,)
        self.prompt_len = torch.full(rows, -1, dtype=torch.long, device=self.device)  # L per row once the prompt is in
        # decoding schedules: blocks since the prompt or the last compression (kvpress's per-layer step count), and what
        # a row held then (as its pattern sees it) at how many tokens seen: min_nbytes counts from there
        self.decode_steps = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.held_base = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.base_seen = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._pending: ScoreContext | None = None
        self._phase: str | None = None
        self.scorer = self.scorer_cls(self.spec)
        for name in self.scorer.slot_state:  # follows the slots: [B, (H,) S]
            setattr(self, name, torch.zeros(*self.key_pos.shape, dtype=torch.float64, device=self.device))

    @property
    def _batch_tensors(self) -> tuple[str, ...]:  # type: ignore[override]
        return (*super()._batch_tensors, "prompt_len", "decode_steps", "held_base", "base_seen", *self._slot_state)

    @property
    def _slot_state(self) -> tuple[str, ...]:
        return self.scorer_cls.slot_state

    @property
    def compressed(self) -> bool:
        """The prompt (the first block) is in: prefill schedules compressed it, decoding schedules count blocks after
        it."""
        return bool((self.prompt_len >= 0).any())

    @property
    def awaits_prompt(self) -> bool:
        """The next block is the prompt and the schedule treats it apart: feed the prompt as ONE block."""
        return self.spec.schedule != "continuous" and not self.compressed

    def _block_phase(self, tokens: int) -> str | None:
        """What a block of `tokens` tokens fed now does by score: "prompt" (compress the prompt), "decoding"
        (compress everything held to budget), "continuous", or None (the pattern's own eviction only)."""
        schedule = self.spec.schedule
        if schedule == "continuous":
            return "continuous"
        if not self.compressed:
            return "prompt" if schedule in ("prefill", "prefill_decoding") else None
        if schedule == "prefill":
            return None
        # kvpress DecodingPress.forward_hook: count this block, compress at the interval-th or a block >= budget
        due = int(self.decode_steps.max()) + 1 >= self.spec.interval or tokens >= self.spec.budget
        return "decoding" if due else None

    def _evicting_now(self) -> bool:
        block = self.seq.block
        return self._block_phase(block.tokens if block is not None else 1) is not None

    @property
    def wants_attention_weights(self) -> bool:  # type: ignore[override]
        return self.needs_weights and self._evicting_now()

    @property
    def wants_queries(self) -> bool:
        return self.needs_queries and self._evicting_now()

    def observe_attention(self, weights: torch.Tensor | None, queries: QueryInputs | None = None) -> None:
        """The block's attention weights [B, Hq, T, S] over the slots `update` returned (and, for methods that
        model future queries, the pre-rotary queries)."""
        if self._staged is None:
            raise CacheError(f"{self.name}: observe_attention needs the block's update first")
        rows = self.scorer.query_rows()
        if weights is not None and rows is not None and weights.shape[2] > rows:
            # kept until the block ends, in every layer: only the rows the score reads (the last queries; with
            # left padding they are each row's last real ones), not [B, Hq, T, S] per layer
            weights = weights[:, :, -rows:].clone()
        self._observed = (weights, queries)

    # -- scores ------------------------------------------------------------------------------------------------
    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[B, Hs, S] float: higher is kept first. Hs = kv heads (per-head methods) or 1."""
        return self.scorer.score(ctx)

    def _targets(self, candidates: torch.Tensor) -> torch.Tensor:
        """Tokens each row (and head) keeps, from its candidate count [B, Hs]."""
        own = self.scorer.targets(candidates)
        if own is not None:
            return own
        if self._phase == "decoding":
            return self.spec.decoding_kept(candidates)
        return self.spec.prompt_kept(candidates)  # the prompt, or every block (continuous: the budget)

    def _context(self, staged, seen: torch.Tensor) -> ScoreContext:
        weights, queries = getattr(self, "_observed", (None, None))
        self._observed = (None, None)
        keys, values, pos, block = staged.keys, staged.values, staged.pos, staged.block
        if keys is None:  # the view was not kept alive (offloaded storage): decode what it held
            keys, values = self.read()
            keys = torch.cat([keys, staged.k], 2)
            values = torch.cat([values, staged.v], 2)
        query_positions = block.positions  # [B, T]; those of the rows kept when observe_attention kept fewer
        if weights is not None and weights.shape[2] < block.tokens:
            query_positions = query_positions[:, -weights.shape[2] :]
        return ScoreContext(keys, values, pos, query_positions, seen, weights, queries)

    def _commit_staged(self, staged) -> None:
        old = {name: getattr(self, name) for name in self._slot_state}
        for name, t in old.items():  # the block's tokens start with nothing accumulated
            setattr(self, name, F.pad(t, (0, staged.tokens)))
        try:
            self._commit_scored(staged)
        except BaseException:
            for name, t in old.items():
                setattr(self, name, t)
            raise

    def _commit_scored(self, staged) -> None:
        block = staged.block if isinstance(staged, BlockWrite) else None
        phase = self._block_phase(block.tokens) if block is not None else None
        if phase is not None:
            ctx = self._context(staged, block.seen_after)
            if self.needs_weights and ctx.weights is None:
                raise CacheError(f"{self.name}: the mixer did not hand over the block's attention weights")
            if self.needs_queries and ctx.queries is None:
                raise CacheError(f"{self.name}: the mixer did not hand over the block's queries")
            self._pending = ctx
        self._phase = phase
        try:
            super()._commit_staged(staged)
        finally:
            self._pending, self._phase = None, None
        if block is not None:
            self._advance(phase, block.seen_after)

    def _advance(self, phase: str | None, seen: torch.Tensor) -> None:
        """After a committed block: the prompt's length, the decoding step count, what a row holds from here."""
        s = self.spec
        if s.schedule == "continuous":
            return
        if not self.compressed:  # that block was the prompt
            needed = s.pattern_needed(seen)
            self.prompt_len = seen.clone()
            self.held_base = needed.clone() if s.schedule == "decoding" else s.prompt_kept(needed)
            self.base_seen = seen.clone()
        elif phase == "decoding":
            self.held_base = s.decoding_kept(self._needed_rows(seen))
            self.base_seen, self.decode_steps = seen.clone(), torch.zeros_like(self.decode_steps)
        elif s.schedule in DECODING_SCHEDULES:
            self.decode_steps = self.decode_steps + 1

    def _needed_rows(self, seen: torch.Tensor) -> torch.Tensor:
        """[B] tokens each row holds by the rules once the prompt is in: what it held at the prompt or the last
        compression plus every token since, within what its pattern still sees."""
        return torch.minimum(self.spec.pattern_needed(seen), self.held_base + (seen - self.base_seen))

    def _abort_staged(self, staged) -> None:
        self._observed = (None, None)
        super()._abort_staged(staged)

    def _evict(self, pos: torch.Tensor, seen: torch.Tensor):
        ctx = self._pending
        rows = _per_row(seen, pos)
        candidates = (pos >= 0) & self.spec.visible(rows, pos)  # [B, (H,) S]: what the next query can still see
        if ctx is None:  # not evicting by score now (prefill schedule after the prompt): only the pattern's own
            return super()._evict(pos, seen)
        cand = candidates if candidates.dim() == 3 else candidates[:, None]  # [B, Hs', S]
        ctx.state = {name: getattr(self, name) for name in self._slot_state}
        for name, t in self.scorer.observe(ctx).items():  # the scorer's running state after this block
            setattr(self, name, t)
            ctx.state[name] = t
        scores = self.score(ctx).to(torch.float64)  # [B, Hs, S]
        hs = scores.shape[1]
        cand = cand.expand(-1, hs, -1) if cand.shape[1] != hs else cand
        target = self._targets(cand.sum(-1))  # [B, Hs]
        keep = int(target.max()) if target.numel() else 0
        if keep >= pos.shape[-1] and bool(cand.all()):
            return None
        slot_pos = ctx.slot_positions().expand(-1, hs, -1)
        # rank by score, ties to the more recent token; non-candidates last
        order = torch.sort(slot_pos, dim=-1, descending=True, stable=True).indices
        ranked = torch.where(cand, scores, -math.inf).gather(-1, order)
        top = order.gather(-1, torch.sort(ranked, dim=-1, descending=True, stable=True).indices)[..., :keep]
        valid = torch.arange(keep, device=pos.device) < target[..., None]  # [B, Hs, keep]
        top_pos = torch.where(valid, slot_pos.gather(-1, top), -1)
        by_pos = torch.sort(top_pos, dim=-1, stable=True).indices  # empty slots first, then position order
        index, valid = top.gather(-1, by_pos), valid.gather(-1, by_pos)
        self._kept_valid = valid if pos.dim() == 3 else valid[:, 0]
        return index if pos.dim() == 3 else index[:, 0]

    def _take(self, index: torch.Tensor) -> None:
        valid = getattr(self, "_kept_valid", None)  # False: a kept slot past the row's (head's) target, now empty
        self._kept_valid = None
        self.storage.take(index, valid)
        for name in self._slot_state:
            t = getattr(self, name)
            setattr(self, name, t.index_select(-1, index) if index.dim() == 1 else t.gather(-1, index))

    # -- accounting --------------------------------------------------------------------------------------------
    def min_nbytes(self) -> int:
        """Per row: what the method keeps of what the pattern needs (continuous: at most `budget`; the other schedules:
        what the row held after the prompt or the last compression, plus every token since)."""
        s = self.spec
        seen = self.seen
        if s.schedule == "continuous":
            needed = s.needed_tokens(seen)
        else:
            needed = torch.where(self.prompt_len >= 0, self._needed_rows(seen), s.pattern_needed(seen))
        needed = needed.tolist()
        return sum(n * s.token_nbytes + min(n, s.residual or 0) * s.dense_token_nbytes for n in needed)


def register_press(
    name: str, spec_cls: type[ScoredSpec], scorer_cls: type[Scorer], example_params: dict[str, Any]
) -> type[ScoredEvictionLayer]:
    """Register a score-based method under its config name: the score-based layer with this spec and scorer (and
    the parameters the conformance kit tries it with). Returns the layer class (`<Scorer>Layer`)."""
    attrs = {
        "__doc__": scorer_cls.__doc__,
        "__module__": scorer_cls.__module__,
        "__qualname__": f"{scorer_cls.__name__}Layer",
        "spec_cls": spec_cls,
        "scorer_cls": scorer_cls,
        "needs_weights": scorer_cls.needs_weights,
        "needs_queries": scorer_cls.needs_queries,
        "example_params": example_params,
    }
    return register_cache_layer(name)(type(f"{scorer_cls.__name__}Layer", (ScoredEvictionLayer,), attrs))
