"""Generation: prefill (whole or in chunks), decode, greedy or sampling, per-row eos, left padding, continuation.

Inputs are sliced by what the cache has already seen: pass `cache=out.cache` with either the whole previous
sequence plus new tokens, or only the new tokens together with the attention mask of the whole sequence.
`use_cache=False` is the oracle: every step recomputes the whole sequence with the same per-layer patterns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from hybridcache.cache import Cache
from hybridcache.models.base import HybridLM

# Prompts longer than this are prefilled in pieces of this size unless prefill_chunk_size says otherwise, so no
# full-length [T, T] mask or score matrix is ever built (sliding/chunked/recurrent memory stays flat in T).
DEFAULT_PREFILL_CHUNK = 1024


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, T_prompt + T_new]
    logits: torch.Tensor  # [B, T_new, V]: the logits each new token was chosen from
    cache: Cache | None  # pass back as cache= to continue (None when use_cache=False)


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row [B] from logits [B, V] after temperature, top-k and top-p filtering."""
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_scores.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(-1)


def _prompt_block(input_ids, attention_mask, cache: Cache | None):
    """What to feed now and the mask of the whole sequence so far."""
    if cache is None:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
        return input_ids, mask
    cached, tokens = cache.columns, input_ids.shape[1]
    if attention_mask is not None and attention_mask.shape[1] == cached + tokens:  # only the new tokens
        return input_ids, attention_mask
    if tokens > cached and (attention_mask is None or attention_mask.shape[1] == tokens):  # the whole sequence
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return input_ids[:, cached:], mask
    if attention_mask is None:  # only new tokens, all real
        return input_ids, torch.ones(input_ids.shape[0], cached + tokens, dtype=torch.long, device=input_ids.device)
    raise ValueError(
        f"the cache holds {cached} tokens; input_ids ({tokens} tokens) must be the whole sequence (more than "
        f"{cached} tokens) or only the new tokens with an attention_mask of {cached + tokens} columns, "
        f"but attention_mask has {attention_mask.shape[1]}"
    )


def _check_capacity(cache: Cache, needed: int) -> None:
    for i, layer in enumerate(cache):
        max_length = getattr(layer.spec, "max_length", None)
        if max_length is not None and needed > max_length:
            raise ValueError(
                f"cache layer {i} is preallocated for max_length={max_length} tokens, but this request needs "
                f"{needed} (prompt plus max_new_tokens - 1); build the cache with max_length >= {needed}"
            )


def compiled_decode_step(model: HybridLM):
    """`model.forward_block` compiled once per model (dynamic ints: the cache's column counter changes each step)."""
    step = getattr(model, "_compiled_decode_step", None)
    if step is None:
        step = torch.compile(model.forward_block, dynamic=True)
        model._compiled_decode_step = step
    return step


@torch.no_grad()
def generate(
    model: HybridLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    use_cache: bool = True,
    cache: Cache | None = None,
    cache_config: Mapping[str, Any] | None = None,
    prefill_chunk_size: int | None = None,
    compile: bool = False,
) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens per row. See the module docstring for continuation.

    `compile=True` runs the decode step through `torch.compile` over a preallocated (static-shape) cache: the
    cache is built with max_length = prompt + max_new_tokens unless one is passed.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor [B, T]")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give every row at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if prefill_chunk_size is not None and (not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1):
        raise ValueError(f"prefill_chunk_size must be a positive integer or None, got {prefill_chunk_size!r}")
    if do_sample:
        _check_sampling(temperature, top_k, top_p)
    if cache is not None and cache_config is not None:
        raise ValueError("pass either cache= (continue from it) or cache_config= (build a new cache), not both")
    if cache is not None and not use_cache:
        raise ValueError("use_cache=False recomputes from scratch and cannot continue from a cache")
    device = model.device
    input_ids = input_ids.to(device)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a 2-d tensor of 0/1")
        if attention_mask.shape[0] != input_ids.shape[0]:
            raise ValueError(f"attention_mask has {attention_mask.shape[0]} rows, input_ids have {input_ids.shape[0]}")
        attention_mask = attention_mask.to(device).long()
    batch = input_ids.shape[0]
    if cache is not None:
        model.check_cache(cache, batch)
    block, full_mask = _prompt_block(input_ids, attention_mask, cache)  # a given cache: slice what it has seen
    if compile and not use_cache:
        raise ValueError("compile=True compiles the cached decode step; it cannot be combined with use_cache=False")
    if use_cache and cache is None:
        max_length = input_ids.shape[1] + max_new_tokens if compile else None
        cache = model.make_cache(batch, cache_config, max_length)
    decode = compiled_decode_step(model) if compile else model.forward_block
    if not bool(full_mask.bool().any(1).all()):
        raise ValueError("every row needs at least one real token (a row of the attention_mask is all zeros)")
    if cache is not None:
        _check_capacity(cache, cache.columns + block.shape[1] + max_new_tokens - 1)
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []), device=device)
    pad_id = model.config.get("pad_token_id")
    pad_id = int(eos[0]) if pad_id is None and eos.numel() else int(pad_id or 0)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    def prefill(tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] after feeding the prompt block (in pieces, so no [T, T] mask is ever built)."""
        if cache is None:  # the oracle: the whole sequence, a fresh cache with the same patterns
            return model(input_ids, model.make_cache(batch, cache_config), full_mask)[:, -1]
        chunk = prefill_chunk_size or min(tokens.shape[1], DEFAULT_PREFILL_CHUNK)
        start = cache.columns
        for i in range(0, tokens.shape[1], chunk):
            piece = tokens[:, i : i + chunk]
            logits = model(piece, cache, full_mask[:, : start + i + piece.shape[1]])
        return logits[:, -1]

    def next_logits(step: int) -> torch.Tensor:
        """Logits [B, V] after feeding generated token `step` (always a real token)."""
        if cache is None:  # recompute the whole sequence so far
            sequence = torch.cat([input_ids, generated[:, : step + 1]], dim=1)
            mask = torch.cat([full_mask, full_mask.new_ones(batch, step + 1)], dim=1)
            return model(sequence, model.make_cache(batch, cache_config), mask)[:, -1]
        return decode(generated[:, step : step + 1], cache, None)[:, -1]

    generated = input_ids.new_full((batch, max_new_tokens), pad_id)  # [B, T_new]
    all_logits = []
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    logits = prefill(block)
    steps = max_new_tokens
    for step in range(max_new_tokens):
        all_logits.append(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        token = sample_next(logits, temperature, top_k, top_p, generator) if do_sample else logits.argmax(-1)
        if eos.numel():
            token = torch.where(done, torch.full_like(token, pad_id), token)
            done |= torch.isin(token, eos)
        generated[:, step] = token
        if step == max_new_tokens - 1 or (eos.numel() and bool(done.all())):
            steps = step + 1
            break
        logits = next_logits(step)
    sequences = torch.cat([input_ids, generated[:, :steps]], dim=1)
    return GenerateOutput(sequences, torch.stack(all_logits, dim=1), cache)
