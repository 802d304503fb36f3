"""Score-based KV compression methods, named and computed as kvpress's presses (NVIDIA kvpress 0.5.5), plus H2O.

Each is a `ScoredEvictionLayer` (scored_eviction.py: targets, modes, per-head storage) with its score. Defaults are
the published ones; `mode` defaults to the method's published semantics (kvpress's presses compress the prompt once:
`prefill`; TOVA and H2O evict while decoding: `continuous`). knorm, tova and streaming_llm also take kvpress's
decoding-time modes `decoding` / `prefill_decoding` (DecodingPress / PrefillDecodingPress, press_schedule.py).

| type | score (higher is kept) | heads |
|---|---|---|
| streaming_llm | the first `n_sink` tokens, then the most recent | shared |
| knorm | -||k||_2 | per kv head |
| snapkv | attention of the last `window_size` queries, averaged, avg-pooled over `kernel_size` slots, averaged over the group; the window itself always kept | per kv head |
| pyramidkv | snapkv's, with per-layer budgets shrinking linearly with depth (`beta`) | per kv head |
| tova | the last query's attention averaged over all heads (prefill: the last token always kept) | shared |
| observed_attention | attention a token received, summed over the queries that see it / their number | per kv head |
| expected_attention | softmax of the attention expected from the prompt's query statistics (mean and covariance of the pre-rotary queries, rotated by the mean rotary matrix of the next `n_future_positions`), times ||v||; `n_sink` first tokens kept | per kv head |
| h2o | attention accumulated over every query so far (heavy hitters), plus the `recent` most recent tokens always kept | per kv head |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridcache.cache.core.base import check_positive_int, tunable
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.registry import register_cache_layer
from hybridcache.cache.methods.scored_eviction import ScoreContext, ScoredEvictionLayer, ScoredSpec

KEEP = float("inf")  # the score of a token a method always keeps (kvpress: max + 1)


def _force(scores: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    return torch.where(where, torch.full_like(scores, KEEP), scores)


def _block_queries(ctx: ScoreContext, last: int | None) -> torch.Tensor:
    """[B, T] which of the block's queries count: the real ones, or only each row's `last` most recent."""
    q = ctx.query_positions
    real = q >= 0
    return real if last is None else real & (q >= ctx.seen[:, None] - last)


# -- streaming_llm -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StreamingLLMSpec(ScoredSpec):
    n_sink: int = tunable(4)
    per_head_positions = False
    decodes = True

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("StreamingLLMSpec", "n_sink", self.n_sink)


@register_cache_layer("streaming_llm")
class StreamingLLMLayer(ScoredEvictionLayer):
    """kvpress StreamingLLMPress: keep the sinks and the most recent tokens."""

    spec_cls = StreamingLLMSpec
    needs_weights = False
    example_params = {"budget": 5, "n_sink": 2}

    def score(self, ctx):
        pos = ctx.slot_positions().double()
        return _force(pos, pos < self.spec.n_sink)


# -- knorm ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class KnormSpec(ScoredSpec):
    decodes = True


@register_cache_layer("knorm")
class KnormLayer(ScoredEvictionLayer):
    """kvpress KnormPress: keys with a small L2 norm are kept (Devoto et al. 2024)."""

    spec_cls = KnormSpec
    needs_weights = False
    example_params = {"compression_ratio": 0.4}

    def score(self, ctx):
        return -torch.linalg.vector_norm(ctx.keys, dim=-1, dtype=torch.promote_types(ctx.keys.dtype, torch.float32))


# -- snapkv / pyramidkv --------------------------------------------------------------------------------------------
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
    window = _block_queries(ctx, window_size)  # [B, T]
    n = window.sum(1).clamp(min=1).to(ctx.weights.dtype)
    att = (ctx.weights * window[:, None, :, None]).sum(2) / n[:, None, None]  # [B, Hq, S]
    pos = ctx.slot_positions()  # [B, Hs, S]
    in_window = pos >= ctx.seen[:, None, None] - window_size
    heads = att.shape[1] // pos.shape[1]
    att = att.masked_fill(in_window.repeat_interleave(heads, 1), 0.0)  # kvpress scores keys[:-window] only
    att = F.avg_pool1d(att, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    return _force(ctx.grouped(att).double(), in_window)


@register_cache_layer("snapkv")
class SnapKVLayer(ScoredEvictionLayer):
    """kvpress SnapKVPress (Li et al. 2024)."""

    spec_cls = SnapKVSpec
    example_params = {"compression_ratio": 0.4, "window_size": 3, "kernel_size": 3}

    def score(self, ctx):
        return snapkv_scores(ctx, self.spec.window_size, self.spec.kernel_size)


@dataclass(frozen=True, kw_only=True)
class PyramidKVSpec(SnapKVSpec):
    beta: int = tunable(20)
    layer_index: int = 0  # from the plan: this layer's decoder index and the stack's depth
    num_layers: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("PyramidKVSpec", "beta", self.beta)
        check_positive_int("PyramidKVSpec", "num_layers", self.num_layers)
        if not 0 <= self.layer_index < self.num_layers:
            raise CacheError(f"PyramidKVSpec: layer_index {self.layer_index} outside [0, {self.num_layers})")

    def layer_budget(self, q_len: int) -> int:
        """kvpress's get_layer_budget (after KVCache-Factory): a linear pyramid between max_num (layer 0) and
        min_num (the last layer) whose mean is the uniform budget; the uniform budget when no pyramid fits."""
        kept = q_len * (1 - self.compression_ratio) if self.budget is None else min(q_len, self.budget)
        w = self.window_size
        capacity = w + kept
        min_num = (capacity - w) / self.beta
        max_num = (capacity - w) * 2 - min_num
        if max_num >= q_len - w:
            max_num = q_len - w
            min_num = (capacity - w) * 2 - max_num
        if not q_len >= max_num >= min_num >= w:
            return max(1, round(kept))
        steps = (max_num - min_num) / (self.num_layers - 1) if self.num_layers > 1 else 0.0
        return round(max_num - self.layer_index * steps)


@register_cache_layer("pyramidkv")
class PyramidKVLayer(SnapKVLayer):
    """kvpress PyramidKVPress (Cai et al. 2024): SnapKV scores, more tokens for lower layers."""

    spec_cls = PyramidKVSpec

    def _targets(self, candidates):
        budgets = [[self.spec.layer_budget(int(c)) if c else 0 for c in row] for row in candidates.tolist()]
        return torch.tensor(budgets, dtype=torch.long, device=candidates.device).clamp(max=candidates)


# -- tova ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TovaSpec(ScoredSpec):
    mode: str = tunable("continuous")
    per_head_positions = False
    decodes = True


@register_cache_layer("tova")
class TovaLayer(ScoredEvictionLayer):
    """TOVA (Oren et al. 2024): the tokens the last query attends to most, averaged over all heads. Continuous (the
    paper's): the current token competes too. The other modes (kvpress TOVAPress, also inside its DecodingPress):
    the last token is always kept."""

    spec_cls = TovaSpec
    example_params = {"budget": 6}

    def score(self, ctx):
        last = ctx.weights[:, :, -1, :].mean(1, keepdim=True).double()  # [B, 1, S]
        if self.spec.mode != "continuous":
            return _force(last, ctx.slot_positions() == ctx.seen[:, None, None] - 1)
        return last


# -- observed_attention --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ObservedAttentionSpec(ScoredSpec):
    pass


def attention_sums(ctx: ScoreContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention each slot received, summed over the block's real queries [B, Hq, S], and how many of them
    could see it [B, Hs, S]."""
    real = _block_queries(ctx, None)
    sums = (ctx.weights * real[:, None, :, None]).sum(2)
    q, pos = ctx.query_positions[:, None, :, None], ctx.slot_positions()[:, :, None, :]  # [B, 1, T, 1], [B, Hs, 1, S]
    seeing = (q >= 0) & (pos >= 0) & (pos <= q)
    return sums, seeing.sum(2)


@register_cache_layer("observed_attention")
class ObservedAttentionLayer(ScoredEvictionLayer):
    """kvpress ObservedAttentionPress: mean attention received from the queries that saw the token (H2O's score
    during the prefill)."""

    spec_cls = ObservedAttentionSpec
    example_params = {"compression_ratio": 0.4}

    def score(self, ctx):
        sums, counts = attention_sums(ctx)
        heads = sums.shape[1] // counts.shape[1]
        return ctx.grouped(sums / counts.clamp(min=1).repeat_interleave(heads, 1)).double()


# -- expected_attention --------------------------------------------------------------------------------------------
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


@register_cache_layer("expected_attention")
class ExpectedAttentionLayer(ScoredEvictionLayer):
    """kvpress ExpectedAttentionPress (Devoto et al. 2025): attention that future queries are expected to pay."""

    spec_cls = ExpectedAttentionSpec
    needs_weights = False
    needs_queries = True
    example_params = {"compression_ratio": 0.4, "n_sink": 1, "n_future_positions": 8}

    def score(self, ctx):
        s, qi = self.spec, ctx.queries
        q = qi.prerope.double()  # [B, Hq, T, D]
        stats = (_block_queries(ctx, None) & (ctx.query_positions >= s.n_sink))[:, None, :, None]  # [B, 1, T, 1]
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
        return _force(scores, sink)


# -- h2o -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class H2OSpec(ScoredSpec):
    mode: str = tunable("continuous")
    recent: int | None = tunable(None)  # most recent tokens always kept (None: half the budget, H2O's default)

    def __post_init__(self):
        super().__post_init__()
        if self.recent is not None and (
            isinstance(self.recent, bool) or not isinstance(self.recent, int) or self.recent < 0
        ):
            raise CacheError(f"H2OSpec: recent must be a non-negative integer, got {self.recent!r}")

    def recent_tokens(self, kept: int) -> int:
        return self.recent if self.recent is not None else kept // 2


@register_cache_layer("h2o")
class H2OLayer(ScoredEvictionLayer):
    """H2O (Zhang et al. 2023): heavy hitters by accumulated attention (per kv head, summed over every query so far
    and averaged over the group) plus a window of recent tokens."""

    spec_cls = H2OSpec
    example_params = {"budget": 6}

    def _allocate(self, batch_size):
        super()._allocate(batch_size)
        self.h2o_acc = torch.zeros(*self.key_pos.shape, dtype=torch.float64, device=self.device)  # [B, H, S]

    @property
    def _batch_tensors(self):
        return (*super()._batch_tensors, "h2o_acc")

    def _commit_staged(self, staged):
        old = self.h2o_acc
        self.h2o_acc = F.pad(old, (0, staged[1].shape[2]))  # the block's tokens start with nothing accumulated
        try:
            super()._commit_staged(staged)
        except BaseException:
            self.h2o_acc = old
            raise

    def score(self, ctx):
        sums, _ = attention_sums(ctx)
        self.h2o_acc = self.h2o_acc + ctx.grouped(sums).double()  # [B, Hkv, S]
        recent = torch.tensor(
            [self.spec.recent_tokens(int(k)) for k in self.spec.kept_of(ctx.seen).tolist()], device=self.device
        )
        return _force(self.h2o_acc, ctx.slot_positions() >= (ctx.seen - recent)[:, None, None])

    def _take(self, index):
        super()._take(index)
        self.h2o_acc = self.h2o_acc.index_select(-1, index) if index.dim() == 1 else self.h2o_acc.gather(-1, index)
