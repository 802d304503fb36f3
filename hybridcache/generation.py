"""Generation: prefill (whole or in chunks), decode, greedy or sampling, per-row eos, left padding, continuation.

Continuation has one rule: with `cache=`, `input_ids` (and `attention_mask`, if given) cover the WHOLE sequence,
i.e. the `cache.columns` tokens the cache saw followed by new ones; the cache's token fingerprint verifies the
first part, so passing only the new tokens is an error, never a silent guess.
`use_cache=False` is the oracle: every step recomputes the whole sequence with the same per-layer patterns.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.cache import Cache
from hybridcache.cache.limits import check_fits
from hybridcache.cache.plan import resolve_plan
from hybridcache.cache.sequence import token_fingerprint
from hybridcache.models.base import (
    GenerationError,
    GenerationTypeError,
    HybridLM,
    check_input_ids,
    check_mask,
    check_mask_tensor,
)
from hybridcache.ops.cpu_kernels import argmax_rows

# Prompts longer than this are prefilled in pieces of this size unless prefill_chunk_size says otherwise, so no
# full-length [T, T] mask or score matrix is ever built (sliding/chunked/recurrent memory stays flat in T).
DEFAULT_PREFILL_CHUNK = 1024


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, T_prompt + T_new]
    logits: torch.Tensor | None  # [B, T_new, V]: the logits each new token was chosen from (None: output_logits=False)
    cache: Cache | None  # pass back as cache= to continue (None when use_cache=False)
    stats: dict[str, Any] | None = None  # speculative decoding / prefix reuse: acceptance, hits, tokens saved


# The smallest temperature: the smallest normal float32. Logits are sampled in float32 and shifted by their row's
# maximum before dividing by T (sample_next), so no T from here up overflows; below it T itself rounds to 0 in float32.
MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)
SEED_RANGE = (-(2**63), 2**64)  # what torch's 64-bit generator seed takes (negative seeds wrap around)


def _check_sampling(temperature: Any, top_k: Any, top_p: Any) -> None:
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not temperature > 0
        or temperature == float("inf")
    ):
        raise GenerationError(f"temperature must be a finite number > 0, got {temperature!r}")
    if temperature < MIN_TEMPERATURE:
        raise GenerationError(
            f"temperature must be >= {MIN_TEMPERATURE:.4g} (the smallest normal float32: logits "
            f"are sampled in float32), got {temperature!r}; for the most likely token use "
            "do_sample=False"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise GenerationError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise GenerationError(f"top_p must be in (0, 1], got {top_p!r}")


def _eos_ids(eos_token_id: Any, vocab_size: int) -> list[int]:
    """eos_token_id (None, an id or a list of ids) as a list of ids in [0, vocab_size)."""
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    if ids is None:
        return []
    if (
        not isinstance(ids, (list, tuple))
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        or not all(0 <= i < vocab_size for i in ids)
    ):
        raise GenerationError(
            f"eos_token_id must be None, a token id or a list of token ids in [0, {vocab_size}), got {eos_token_id!r}"
        )
    return list(ids)


def awaiting_prompt(cache: Cache) -> bool:
    """Whether a layer of `cache` compresses the next block it sees as the prompt (score-based, mode: prefill)."""
    return any(
        getattr(layer, "spec", None) is not None
        and getattr(layer.spec, "mode", None) == "prefill"
        and not getattr(layer, "compressed", True)
        for layer in cache.layers
    )


def greedy_next(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V].argmax(-1): by the CPU kernel for float32 (torch's answer, ~20x faster on a 262k vocabulary,
    where torch's argmax takes 2% of a decode step), by torch otherwise."""
    out = argmax_rows(logits)
    return out if out is not None else logits.argmax(-1)


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row [B] from logits [B, V] after temperature, top-k and top-p filtering."""
    scores = logits.float()
    if temperature < 1:  # dividing amplifies: shift each row's maximum to 0 first, so no score overflows to +inf
        scores = scores - scores.amax(-1, keepdim=True)
    scores = scores / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_scores.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(-1)


def _continuation(input_ids: torch.Tensor, mask: torch.Tensor, cache: Cache) -> torch.Tensor:
    """The tokens the cache has not seen, after checking that input_ids start with what it saw."""
    cached, width = cache.columns, input_ids.shape[1]
    if width <= cached:
        raise GenerationError(
            f"with cache=, input_ids must be the whole sequence: the {cached} tokens the cache saw followed by new "
            f"ones, but input_ids have only {width} columns"
        )
    seen = mask[:, :cached].sum(1)
    if not torch.equal(seen, cache.seq.seen):
        row = int((seen != cache.seq.seen).nonzero()[0])
        raise GenerationError(
            f"attention_mask row {row} marks {int(seen[row])} of the first {cached} columns as real, but the cache saw "
            f"{int(cache.seq.seen[row])} real tokens in that row"
        )
    if cache.seq.fingerprint is None:
        raise GenerationError(
            "this cache does not know which tokens it saw (it was fed outside the model, without token ids), so "
            "a continuation cannot be checked against it; continue it with model(new_ids, cache) instead"
        )
    prefix = mask[:, :cached].bool()
    positions = torch.where(prefix, prefix.long().cumsum(1) - 1, -1)
    differs = token_fingerprint(input_ids[:, :cached], positions) != cache.seq.fingerprint
    if bool(differs.any()):
        raise GenerationError(
            f"input_ids[:, :{cached}] (row {int(differs.nonzero()[0])}) are not the tokens the cache saw. With "
            "cache=, pass the whole sequence (the cache's tokens followed by new ones), e.g. out.sequences plus "
            "new tokens, never only the new tokens"
        )
    return input_ids[:, cached:]


def _check_speculative(model, draft, k, do_sample, cache, use_cache, compile, prefix_cache) -> None:
    if not all(hasattr(draft, a) for a in ("run_block", "make_cache", "vocab_size", "device")):
        raise GenerationError(
            f"draft_model must be a hybridcache model (hc.from_pretrained, EarlyExitDraft), got {type(draft).__name__}"
        )
    if draft.vocab_size != model.vocab_size:
        raise GenerationError(
            f"the draft model's vocabulary ({draft.vocab_size}) differs from the target's "
            f"({model.vocab_size}); speculative decoding needs the same tokenizer"
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise GenerationError(f"num_draft_tokens must be a positive integer, got {k!r}")
    if do_sample:
        raise GenerationError("speculative decoding here is greedy: do_sample=True is not supported with draft_model")
    for bad, what in (
        (cache is not None, "cache="),
        (not use_cache, "use_cache=False"),
        (compile, "compile=True"),
        (prefix_cache is not None, "prefix_cache="),
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


_COMPILE_LOCK = threading.Lock()


def compiled_decode_step(model: HybridLM):
    """`model.forward_block` compiled once per model (dynamic ints: the cache's column counter changes each step)."""
    with _COMPILE_LOCK:  # two threads must not both compile and race on the attribute
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
    draft_model: HybridLM | None = None,
    num_draft_tokens: int = 4,
    draft_cache_config: Mapping[str, Any] | None = None,
    prefix_cache: Any = None,
    output_logits: bool = True,
) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens per row. See the module docstring for continuation.

    `compile=True` runs the decode step through `torch.compile` over a preallocated (static-shape) cache: the
    cache is built with max_length = prompt + max_new_tokens unless one is passed.

    `draft_model=` decodes speculatively (greedy; hybridcache/speculative.py): the draft proposes
    `num_draft_tokens` tokens, the target verifies them in one block, both caches roll back to the accepted prefix;
    the tokens are those of plain greedy decoding, `out.stats` has the acceptance rate. `prefix_cache=` (a
    `PrefixStore`, hybridcache/prefix_cache.py) starts from the longest stored prefix of the prompt.

    `output_logits=False` keeps only the tokens (`out.logits` is None): the logits are B x V floats per new token
    (1 MB per row and token on a 262k vocabulary), which a long or batched generation would otherwise keep.
    """
    check_input_ids(input_ids, model.vocab_size)
    check_mask_tensor(attention_mask)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if prefill_chunk_size is not None and (
        isinstance(prefill_chunk_size, bool) or not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1
    ):
        raise GenerationError(f"prefill_chunk_size must be a positive integer or None, got {prefill_chunk_size!r}")
    _check_sampling(temperature, top_k, top_p)  # also when greedy: a bad value is a bug in the caller either way
    for name, flag in (
        ("do_sample", do_sample),
        ("use_cache", use_cache),
        ("compile", compile),
        ("output_logits", output_logits),
    ):
        if not isinstance(flag, bool):
            raise GenerationError(f"{name} must be True or False, got {flag!r}")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]
    ):
        raise GenerationError(
            f"seed must be None or an integer that fits torch's 64-bit seed, in [-2**63, 2**64), got {seed!r}"
        )
    if cache is not None and cache_config is not None:
        raise GenerationError("pass either cache= (continue from it) or cache_config= (build a new cache), not both")
    if cache is not None and not use_cache:
        raise GenerationError("use_cache=False recomputes from scratch and cannot continue from a cache")
    if compile and not use_cache:
        raise GenerationError(
            "compile=True compiles the cached decode step; it cannot be combined with use_cache=False"
        )
    if prefix_cache is not None and not all(callable(getattr(prefix_cache, f, None)) for f in ("prepare", "finish")):
        raise GenerationTypeError(
            f"prefix_cache must be a PrefixStore (hybridcache.prefix_cache), got {type(prefix_cache).__name__}"
        )
    if draft_model is not None:
        _check_speculative(model, draft_model, num_draft_tokens, do_sample, cache, use_cache, compile, prefix_cache)
    device = model.device
    input_ids = input_ids.to(device)
    batch, width = input_ids.shape
    if attention_mask is None:
        full_mask = torch.ones(batch, width, dtype=torch.bool, device=device)
    else:
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.shape[0] != batch:
            raise GenerationError(f"attention_mask has {attention_mask.shape[0]} rows, input_ids have {batch}")
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            got = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask).__name__
            )
            raise GenerationError(
                f"attention_mask must match input_ids {tuple(input_ids.shape)} (the whole sequence), got {got}"
            )
        full_mask = check_mask(attention_mask.to(device), torch.zeros(batch, dtype=torch.long, device=device), width)
    if not bool(full_mask.any(1).all()):
        raise GenerationError("every row needs at least one real token (a row of the attention_mask is all zeros)")
    eos = torch.tensor(_eos_ids(eos_token_id, model.vocab_size), dtype=torch.long, device=device)
    pad_id = model.config.get("pad_token_id")
    pad_id = int(eos[0]) if pad_id is None and eos.numel() else int(pad_id or 0)
    if cache is not None:
        model.check_cache(cache, batch)
    check_generation_memory(model, cache, cache_config, batch, width + max_new_tokens, max_new_tokens, output_logits)
    if draft_model is not None:
        from hybridcache.speculative import speculative_generate

        sequences, logits, cache, _, stats = speculative_generate(
            model,
            draft_model,
            input_ids,
            full_mask,
            max_new_tokens,
            num_draft_tokens,
            eos,
            pad_id,
            cache_config,
            draft_cache_config,
            prefill_chunk_size,
        )
        cache.owner = weakref.ref(model)
        return GenerateOutput(sequences, logits if output_logits else None, cache, stats)
    if prefix_cache is not None:
        if cache is not None or not use_cache or compile:
            raise GenerationError(
                "prefix_cache= builds the cache itself: do not combine it with cache=, use_cache=False or compile=True"
            )
        cache, prefix_stats = prefix_cache.prepare(model, input_ids, full_mask, cache_config)
        out = generate(
            model,
            input_ids,
            attention_mask,
            max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos_token_id,
            cache=cache,
            prefill_chunk_size=prefill_chunk_size,
            output_logits=output_logits,
        )
        out.stats = prefix_cache.finish(model, out, prefix_stats)
        return out
    if cache is not None:
        block = _continuation(input_ids, full_mask, cache)
    else:
        block = input_ids
    if use_cache and cache is None:
        max_length = int(full_mask.sum(1).max()) + max_new_tokens if compile else None
        cache = model.make_cache(batch, cache_config, max_length)
    if cache is not None:
        cache.owner = weakref.ref(model)  # what `cache.save(path)` records the identity of
    if cache is not None:  # every prefill piece and decode step must fit: check before the first write
        seen_after = cache.seq.seen + full_mask[:, cache.columns :].sum(1) + max_new_tokens - 1
        try:
            cache.check_capacity(seen_after)
        except ValueError as e:
            raise GenerationError(
                f"{e} (this request needs {int(seen_after.max())} tokens per row: the prompt plus max_new_tokens - 1)"
            ) from None
    decode = compiled_decode_step(model) if compile else model.forward_block
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    def prefill(tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] after feeding the prompt block (in pieces, so no [T, T] mask is ever built)."""
        if cache is None:  # the oracle: the whole sequence, a fresh cache with the same patterns
            return model(input_ids, model.make_cache(batch, cache_config), full_mask)[:, -1]
        chunk = prefill_chunk_size or min(tokens.shape[1], DEFAULT_PREFILL_CHUNK)
        if awaiting_prompt(cache):  # a prefill-mode method compresses at the end of the first block: the prompt
            if prefill_chunk_size is not None and prefill_chunk_size < tokens.shape[1]:
                raise GenerationError(
                    f"prefill_chunk_size={prefill_chunk_size}: this cache compresses the prompt "
                    "once, at the end of its first block (mode: prefill), so the prompt is fed as "
                    "one block; leave prefill_chunk_size unset, or use mode: continuous"
                )
            chunk = tokens.shape[1]
        start = cache.columns
        for i in range(0, tokens.shape[1], chunk):
            piece = tokens[:, i : i + chunk]
            valid = full_mask[:, start + i : start + i + piece.shape[1]]
            logits = model.run_block(piece, cache, None if bool(valid.all()) else valid, last_only=True)
        return logits[:, -1]

    def next_logits(step: int) -> torch.Tensor:
        """Logits [B, V] after feeding generated token `step` (always a real token)."""
        if cache is None:  # recompute the whole sequence so far
            sequence = torch.cat([input_ids, generated[:, : step + 1]], dim=1)
            mask = torch.cat([full_mask, full_mask.new_ones(batch, step + 1)], dim=1)
            return model(sequence, model.make_cache(batch, cache_config), mask)[:, -1]
        return model.run_block(generated[:, step : step + 1], cache, None, step=decode, check=False)[:, -1]

    generated = input_ids.new_full((batch, max_new_tokens), pad_id)  # [B, T_new]
    all_logits = []
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    logits = prefill(block)
    steps = max_new_tokens
    for step in range(max_new_tokens):
        if output_logits:
            all_logits.append(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        token = sample_next(logits, temperature, top_k, top_p, generator) if do_sample else greedy_next(logits)
        if eos.numel():
            token = torch.where(done, torch.full_like(token, pad_id), token)
            done |= torch.isin(token, eos)
        generated[:, step] = token
        if step == max_new_tokens - 1 or (eos.numel() and bool(done.all())):
            steps = step + 1
            break
        logits = next_logits(step)
    sequences = torch.cat([input_ids, generated[:, :steps]], dim=1)
    return GenerateOutput(sequences, torch.stack(all_logits, dim=1) if output_logits else None, cache)
