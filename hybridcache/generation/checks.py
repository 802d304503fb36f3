"""What `generate` and `beam_search` check before any work: the request's tensors, which options combine, and whether
its memory can fit. Every refusal is a named GenerationError (or CacheMemoryError for memory) and changes nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridcache.cache import Cache
from hybridcache.cache.core.limits import check_fits
from hybridcache.cache.core.plan import resolve_plan
from hybridcache.generation.config import GenerationConfig
from hybridcache.models.core.base import GenerationError, GenerationTypeError, HybridLM, check_mask


def request_mask(input_ids: torch.Tensor, attention_mask: Any, device: torch.device, what: str = "") -> torch.Tensor:
    """The bool mask [B, T] of a request (all real when `attention_mask` is None), checked against input_ids [B, T]
    (on `device`): the same shape, 0/1 values, left padding. `what` follows input_ids' shape in the message."""
    batch, width = input_ids.shape
    if attention_mask is None:
        return torch.ones(batch, width, dtype=torch.bool, device=device)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.shape[0] != batch:
        raise GenerationError(f"attention_mask has {attention_mask.shape[0]} rows, input_ids have {batch}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise GenerationError(f"attention_mask must match input_ids {tuple(input_ids.shape)}{what}, got {got}")
    return check_mask(attention_mask.to(device), torch.zeros(batch, dtype=torch.long, device=device), width)


def check_options(
    model: HybridLM, cfg: GenerationConfig, cache: Any, cache_config: Any, draft: Any, prefix_cache: Any, hooks: bool
) -> None:
    """Which of generate's options exclude each other (`hooks`: logits processors were passed)."""
    if cache is not None and cache_config is not None:
        raise GenerationError("pass either cache= (continue from it) or cache_config= (build a new cache), not both")
    if cache is not None and not cfg.use_cache:
        raise GenerationError("use_cache=False recomputes from scratch and cannot continue from a cache")
    if prefix_cache is not None and not all(callable(getattr(prefix_cache, f, None)) for f in ("prepare", "finish")):
        raise GenerationTypeError(
            f"prefix_cache must be a PrefixStore (hybridcache.generation.sources.prefix), "
            f"got {type(prefix_cache).__name__}"
        )
    if draft is not None:
        check_speculative(model, draft, cfg, cache, prefix_cache, hooks)
    if prefix_cache is not None and (cache is not None or not cfg.use_cache or cfg.compile):
        raise GenerationError(
            "prefix_cache= builds the cache itself: do not combine it with cache=, use_cache=False or compile=True"
        )


MAX_DRAFT_TOKENS = 256  # a round verifies k + 1 tokens in one block; every cache keeps k columns to rewind


def check_speculative(model: HybridLM, draft: Any, cfg: GenerationConfig, cache, prefix_cache, hooks: bool) -> None:
    from hybridcache.generation.sources.drafts import PromptLookupDraft  # the drafters' module imports this one

    lookup = isinstance(draft, PromptLookupDraft)
    if not lookup and not all(hasattr(draft, a) for a in ("feed_block", "make_cache", "vocab_size", "device")):
        raise GenerationError(
            "draft_model must be a hybridcache model (hc.from_pretrained, EarlyExitDraft) or a PromptLookupDraft, "
            f"got {type(draft).__name__}"
        )
    if not lookup and draft.vocab_size != model.vocab_size:
        raise GenerationError(
            f"the draft model's vocabulary ({draft.vocab_size}) differs from the target's "
            f"({model.vocab_size}); speculative decoding needs the same tokenizer"
        )
    k = cfg.num_draft_tokens
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise GenerationError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
    for bad, what in (
        (cache is not None, "cache="),
        (not cfg.use_cache, "use_cache=False"),
        (cfg.compile, "compile=True"),
        (prefix_cache is not None, "prefix_cache="),
        (hooks, "logits_processor= (verification reads the target's own distribution at every drafted position)"),
    ):
        if bad:
            raise GenerationError(f"draft_model= builds both caches itself and cannot be combined with {what}")


def cache_row_nbytes(model: HybridLM, cache: Cache | None, cache_config: Mapping[str, Any] | None, tokens: int) -> int:
    """Bytes one row of the cache holds once it has seen `tokens` tokens (from its specs; the specs of the cache
    `cache_config` would build when `cache` is None)."""
    if cache is not None:
        return sum(layer.spec.held_nbytes(1, tokens) for layer in cache.layers)
    return resolve_plan(model.native_layers(), cache_config, None).held_nbytes(1, tokens)


def check_generation_memory(
    model: HybridLM,
    cache: Cache | None,
    cache_config: Mapping[str, Any] | None,
    rows: int,
    tokens: int,
    new_tokens: int,
    output_logits: bool,
    what: str = "this generation",
    vocab_rows: int = 1,
) -> None:
    """Refuse (CacheMemoryError, before the first allocation) a request whose memory cannot fit. Per row: the cache
    after `tokens` tokens twice (dynamic storage grows into as many spare slots again; a reorder copies), the
    sequence and new tokens (int64), `vocab_rows` float32 vectors of the vocabulary's size (the step's logits;
    beam search also keeps log-probabilities and candidates) and the kept logits (the per-step list and the
    stacked result). A lower bound: activations are not counted."""
    vocab = model.vocab_size
    per_row = (
        2 * cache_row_nbytes(model, cache, cache_config, tokens) + 8 * (tokens + new_tokens) + 4 * vocab * vocab_rows
    )
    if output_logits:
        per_row += 2 * 4 * vocab * new_tokens
    hint = "fewer rows or new tokens" + (", or output_logits=False" if output_logits else "")
    check_fits(rows * per_row, model.device, f"{what} ({rows} rows, {tokens} tokens each)", hint)


def check_capacity(cache: Cache, full_mask: torch.Tensor, max_new_tokens: int) -> None:
    """Every prefill piece and decode step must fit a preallocated cache: checked before the first write."""
    seen_after = cache.seq.seen + full_mask[:, cache.columns :].sum(1) + max_new_tokens - 1
    try:
        cache.check_capacity(seen_after)
    except ValueError as e:
        raise GenerationError(
            f"{e} (this request needs {int(seen_after.max())} tokens per row: the prompt plus max_new_tokens - 1)"
        ) from None
