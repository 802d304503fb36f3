"""Generation: one loop over named parts. Prefill (whole or in chunks), decode, greedy or sampling, per-row eos,
left padding, continuation.

    config  (GenerationConfig)    every scalar setting; today's keywords override its fields
    source  (generation/sources/cached.py)         where each step's logits come from: DecodeSource (cached, or the
                                  recompute
                                  oracle with use_cache=False), PrefixSource (prefix_cache=), SpeculativeSource
                                  (draft_model=, generation/sources/speculative.py)
    chooser (generation/sampling.py)         the user's logits processors, then greedy or temperature / top-k / top-p
    sampling
    stop    (generation/hooks.py) eos and the user's stopping criteria, per row; a finished row is padded
    streamer                      put(tokens) once per step, end() once

Continuation (generation/sources/cached.py): with `cache=`, `input_ids` (and `attention_mask`) cover the WHOLE
sequence, the
`cache.columns` tokens the cache saw followed by new ones; passing only the new tokens is an error.
Beam search (generation/sources/beam.py) is one more source over the same loop: `BeamSource` keeps B * num_beams rows,
scores
the processed log-probabilities and reorders the rows (and the cache) before each step's tokens reach the loop.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.accel import steady_unless_hooked
from hybridcache.cache import Cache
from hybridcache.generation.checks import (  # noqa: F401  (re-exported)
    cache_row_nbytes,
    check_capacity,
    check_generation_memory,
    check_options,
    request_mask,
)
from hybridcache.generation.config import GenerationConfig, GenerationConfigError  # noqa: F401
from hybridcache.generation.hooks import EosCriteria, StoppingCriteriaList, as_streamer
from hybridcache.generation.request import Request
from hybridcache.generation.sampling import MIN_TEMPERATURE, TokenChooser, eos_ids, greedy_next, pad_token, sample_next  # noqa: F401
from hybridcache.generation.sources.cached import (  # noqa: F401  (re-exported: the names generation/loop.py always had)
    DEFAULT_PREFILL_CHUNK,
    DecodeSource,
    GenerationState,
    PrefixSource,
    awaiting_prompt,
    check_real_rows,
    compiled_decode_step,
)
from hybridcache.generation.sources.speculative import SpeculativeSource
from hybridcache.models.core.base import GenerationError, HybridLM, check_input_ids, check_mask_tensor  # noqa: F401


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, T_prompt + T_new]
    logits: torch.Tensor | None  # [B, T_new, V]: the logits each new token was chosen from (None: output_logits=False)
    cache: Cache | None  # pass back as cache= to continue (None when use_cache=False)
    stats: dict[str, Any] | None = None  # speculative decoding / prefix reuse: acceptance, hits, tokens saved


@torch.no_grad()
def generate(
    model: HybridLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    *,
    generation_config: GenerationConfig | None = None,
    cache: Cache | None = None,
    cache_config: Mapping[str, Any] | None = None,
    draft_model: HybridLM | None = None,
    draft_cache_config: Mapping[str, Any] | None = None,
    prefix_cache: Any = None,
    logits_processor: Iterable[Any] = (),
    stopping_criteria: Iterable[Any] = (),
    streamer: Any = None,
    **settings: Any,
) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens per row (see the module docstring for the parts and continuation).

    Settings (GenerationConfig's fields, as keywords or in `generation_config=`): max_new_tokens, do_sample,
    temperature, top_k, top_p, seed, eos_token_id, pad_token_id, use_cache, prefill_chunk_size, compile,
    num_draft_tokens, output_logits, decode_runs. `compile=True` runs the decode step through `torch.compile` over a
    preallocated (static-shape) cache. `draft_model=` decodes speculatively (greedy;
    generation/sources/speculative.py): the tokens
    are those of plain greedy decoding, `out.stats` has the acceptance rate. `prefix_cache=` (a `PrefixStore`)
    starts from the longest stored prefix of the prompt. `output_logits=False` keeps only the tokens.
    `decode_runs=False` feeds the cache at every decode step (accel/runs/decode_run.py: the same tokens and logits).
    `logits_processor`: callables (input_ids [B, T], scores [B, V]) -> scores, before the sampler;
    `stopping_criteria`: callables (input_ids, scores) -> BoolTensor [B] (rows to finish); `streamer`: an object
    with put(tokens [B]) and end(), or a callable fn(tokens [B]).
    """
    if max_new_tokens is not None:
        settings["max_new_tokens"] = max_new_tokens
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise GenerationConfigError(f"generation_config must be a GenerationConfig, got {type(generation_config)}")
    cfg = (generation_config or GenerationConfig()).update(**settings).validate()
    chooser_hooks = list(logits_processor)
    # the cache belongs to this thread for the whole call: another thread's reset or feed between two steps raises
    with cache.claimed() if isinstance(cache, Cache) else contextlib.nullcontext():
        req = Request.build(
            model,
            input_ids,
            attention_mask,
            cfg,
            cache=cache,
            cache_config=cache_config,
            draft_model=draft_model,
            prefix_cache=prefix_cache,
            processors=bool(chooser_hooks),
        )
        eos, pad_id, device = req.eos, req.pad_id, model.device
        state = GenerationState(
            req.input_ids, req.mask, req.input_ids.new_full((req.batch, cfg.max_new_tokens), pad_id)
        )
        source = _source(model, cfg, state, cache, cache_config, draft_model, draft_cache_config, prefix_cache)
        generator = torch.Generator(device=device).manual_seed(cfg.seed) if cfg.seed is not None else None
        chooser = TokenChooser(chooser_hooks, cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p, generator)
        stop = StoppingCriteriaList([*([EosCriteria(eos)] if eos.numel() else []), *stopping_criteria])
        streamer = as_streamer(streamer)
        # no code but ours between the steps (no processors, criteria, streamer or hooks): the modules stay as they are
        ours = not chooser.processors and streamer is None and len(stop.criteria) == bool(eos.numel())
        if isinstance(source, DecodeSource) and ours and cfg.decode_runs:
            source.runs = True  # decode runs (accel/runs/decode_run.py) where the steps are steady
            if not cfg.do_sample:  # plain greedy choices, stopped by eos only: many steps per C call
                source.greedy = (eos.tolist(), cfg.output_logits)
        try:
            with steady_unless_hooked(ours, model, draft_model if isinstance(draft_model, torch.nn.Module) else None):
                logits = token_loop(source, chooser, stop, streamer, state, pad_id, cfg.output_logits)
        except BaseException:
            getattr(source, "abandon", lambda: None)()
            raise
        out = GenerateOutput(state.sequences(), logits, source.cache)
        out.stats = source.finish(out, state)
        if out.cache is not None:
            out.cache.owner = weakref.ref(model)  # what `cache.save(path)` records the identity of
        return out


def token_loop(source, chooser: TokenChooser, stop: StoppingCriteriaList, streamer, state, pad_id, keep_logits: bool):
    """The generation loop (generate's and beam search's): the source steps, the loop pads finished rows, records,
    streams and stops. Returns the kept logits [B, T_new, V]."""
    kept = []
    choose = chooser.bind(lambda: state.sequences() if chooser.processors else state.input_ids)
    for token, logits in source.steps(choose, state):
        if keep_logits:
            kept.append(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        token = torch.where(state.done, torch.full_like(token, pad_id), token)
        state.generated[:, state.count] = token
        state.count += 1
        if streamer is not None:
            streamer.put(token)
        if stop:
            state.done |= stop(state.sequences(), logits)
        if state.count == state.generated.shape[1] or bool(state.done.all()):
            break
    if streamer is not None:
        streamer.end()
    return torch.stack(kept, dim=1) if keep_logits else None


def _source(model, cfg: GenerationConfig, state, cache, cache_config, draft_model, draft_cache_config, prefix_cache):
    """The token source this request decodes from (and, for plain decoding, the cache it builds or continues)."""
    if draft_model is not None:
        return SpeculativeSource(
            model, draft_model, cfg.num_draft_tokens, cache_config, draft_cache_config, cfg.prefill_chunk_size
        )
    if prefix_cache is not None:
        source = PrefixSource(model, prefix_cache, state, cache_config, cfg.prefill_chunk_size)
    else:
        continues = cache is not None
        if cfg.use_cache and cache is None:
            max_length = int(state.mask.sum(1).max()) + cfg.max_new_tokens if cfg.compile else None
            cache = model.make_cache(state.input_ids.shape[0], cache_config, max_length)
        source = DecodeSource(model, cache, cache_config, cfg.prefill_chunk_size, cfg.compile, continues)
    if source.cache is not None:
        check_capacity(source.cache, state.mask, cfg.max_new_tokens)
    return source
