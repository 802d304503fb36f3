"""Token sources for the generation loop: where each step's logits come from.

A source has `steps(choose, state)`, a generator of (token [B], logits [B, V]) pairs: the loop (generation/loop.py)
pads, records, streams and stops; it stops the generator by breaking out, so nothing is fed after the last token.
- `DecodeSource`: prefill the prompt (in pieces), then feed each chosen token through the cache; without a cache,
  the oracle: every step recomputes the whole sequence with the same per-layer patterns.
- `PrefixSource`: a `DecodeSource` over a cache a `PrefixStore` prepared (the longest stored prefix of the prompt).
- `SpeculativeSource` (generation/sources/speculative.py): a draft proposes, the target verifies; several tokens per
round.

Continuation has one rule: with `cache=`, `input_ids` (and `attention_mask`, if given) cover the WHOLE sequence,
i.e. the `cache.columns` tokens the cache saw followed by new ones; the cache's token fingerprint verifies the
first part, so passing only the new tokens is an error, never a silent guess.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridcache.accel import NonFiniteLogits
from hybridcache.cache import Cache
from hybridcache.cache.core.sequence import token_fingerprint
from hybridcache.generation.sampling import greedy_next
from hybridcache.models.core.base import GenerationError, HybridLM, check_cached_columns

# Prompts longer than this are prefilled in pieces of this size unless prefill_chunk_size says otherwise, so no
# full-length [T, T] mask or score matrix is ever built (sliding/chunked/recurrent memory stays flat in T).
DEFAULT_PREFILL_CHUNK = 1024

_BODY = HybridLM.forward_block  # what a decode run does a step of
Step = Iterator[tuple[torch.Tensor, torch.Tensor]]  # (token [B], the logits [B, V] it was chosen from)


@dataclass
class GenerationState:
    """What the loop has produced so far; sources read it (the tokens as padded, the finished rows)."""

    input_ids: torch.Tensor  # [B, T] the whole request
    mask: torch.Tensor  # [B, T] bool
    generated: torch.Tensor  # [B, max_new_tokens], pad_token_id beyond `count`
    done: torch.Tensor = field(init=False)  # [B] rows a stopping criterion finished
    count: int = 0

    def __post_init__(self) -> None:
        self.done = torch.zeros(self.generated.shape[0], dtype=torch.bool, device=self.generated.device)

    def sequences(self) -> torch.Tensor:
        """[B, T + count]: the request followed by the tokens generated so far."""
        return torch.cat([self.input_ids, self.generated[:, : self.count]], dim=1)


def check_real_rows(mask: torch.Tensor) -> None:
    """Every row of a request's bool mask [B, T] has a real token (else its first step has nothing to attend to)."""
    if not bool(mask.any(1).all()):
        raise GenerationError("every row needs at least one real token (a row of the attention_mask is all zeros)")


def awaiting_prompt(cache: Cache) -> bool:
    """Whether a layer of `cache` treats the next block it sees as the prompt (score-based, schedules prefill, decoding,
    prefill_decoding: the prompt goes in as one block, as kvpress's prefill)."""
    return any(getattr(layer, "awaits_prompt", False) for layer in cache.layers)


_COMPILE_LOCK = threading.Lock()


def compiled_decode_step(model: HybridLM):
    """`model.forward_block` compiled once per model (dynamic ints: the cache's column counter changes each step)."""
    with _COMPILE_LOCK:  # two threads must not both compile and race on the attribute
        step = getattr(model, "_compiled_decode_step", None)
        if step is None:
            step = torch.compile(model.forward_block, dynamic=True)
            model._compiled_decode_step = step
    return step


def continuation(input_ids: torch.Tensor, mask: torch.Tensor, cache: Cache) -> torch.Tensor:
    """The tokens the cache has not seen, after checking that input_ids start with what it saw."""
    cached, width = cache.columns, input_ids.shape[1]
    if width <= cached:
        raise GenerationError(
            f"with cache=, input_ids must be the whole sequence: the {cached} tokens the cache saw followed by new "
            f"ones, but input_ids have only {width} columns"
        )
    check_cached_columns(mask, cache)
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


class DecodeSource:
    """Prefill, then one token per step through `cache` (None: the recompute oracle)."""

    def __init__(
        self,
        model: HybridLM,
        cache: Cache | None,
        cache_config: Mapping[str, Any] | None,
        prefill_chunk_size: int | None,
        compile: bool = False,
        continues: bool = False,
    ) -> None:
        self.model, self.cache, self.cache_config, self.chunk_size = model, cache, cache_config, prefill_chunk_size
        self.continues = continues  # the cache was handed in: input_ids must start with what it saw
        self.decode = compiled_decode_step(model) if compile else model.forward_block
        # decode runs (accel/runs/decode_run.py): only for a caller that changes nothing between steps but through
        # this source (generate's plain decoding: not beam search, which reorders the cache) and says so by
        # `runs = True`; False once one did not apply in this generation
        self.runs = False
        self._run = None  # the open decode run (accel/runs/decode_run.py DecodeRun)
        # greedy runs (DecodeRun.greedy: many steps in one C call): (eos ids, keep logits) from a caller whose
        # tokens are plain greedy choices stopped by eos only, with runs on; None: off
        self.greedy: tuple[list[int], bool] | None = None

    def steps(self, choose: Callable[[torch.Tensor], torch.Tensor], state: GenerationState) -> Step:
        first = self._one_uncached(state) if self.greedy is not None else None
        if first is not None:  # a continuation of one new token: it is the greedy run's first step
            yield from self._greedy_steps(state, first)
        logits = self.prefill(state) if state.count == 0 else self.next_logits(state)
        while True:
            yield choose(logits), logits
            if self.greedy is not None:
                yield from self._greedy_steps(state)  # (returns where a greedy run does not apply)
            logits = self.next_logits(state)

    def prefill(self, state: GenerationState) -> torch.Tensor:
        """Logits [B, V] after feeding the prompt block (in pieces, so no [T, T] mask is ever built)."""
        model, cache, batch = self.model, self.cache, state.input_ids.shape[0]
        if cache is None:  # the oracle: the whole sequence, a fresh cache with the same patterns
            return model(state.input_ids, model.make_cache(batch, self.cache_config), state.mask)[:, -1]
        tokens = continuation(state.input_ids, state.mask, cache) if self.continues else state.input_ids
        chunk = self.chunk_size or min(tokens.shape[1], DEFAULT_PREFILL_CHUNK)
        if awaiting_prompt(
            cache
        ):  # a method with schedule prefill compresses at the end of the first block: the prompt
            if self.chunk_size is not None and self.chunk_size < tokens.shape[1]:
                raise GenerationError(
                    f"prefill_chunk_size={self.chunk_size}: this cache compresses the prompt "
                    "once, at the end of its first block (schedule: prefill), so the prompt is fed as "
                    "one block; leave prefill_chunk_size unset, or use schedule: continuous"
                )
            chunk = tokens.shape[1]
        start = cache.columns
        for i in range(0, tokens.shape[1], chunk):
            piece = tokens[:, i : i + chunk]
            valid = state.mask[:, start + i : start + i + piece.shape[1]]
            logits = model.feed_block(piece, cache, None if bool(valid.all()) else valid, last_only=True)
        return logits[:, -1]

    def next_logits(self, state: GenerationState) -> torch.Tensor:
        """Logits [B, V] after feeding the last generated token (as padded; always a real token)."""
        model, n = self.model, state.count
        if self.cache is None:  # recompute the whole sequence so far
            mask = torch.cat([state.mask, state.mask.new_ones(state.mask.shape[0], n)], dim=1)
            return model(state.sequences(), model.make_cache(mask.shape[0], self.cache_config), mask)[:, -1]
        ids = state.generated[:, n - 1 : n]
        logits = self._run_step(ids, state) if self.runs else None
        if logits is not None:
            return logits
        return model.feed_block(ids, self.cache, None, step=self.decode, check=False)[:, -1]

    def _one_uncached(self, state: GenerationState) -> torch.Tensor | None:
        """The one token [1, 1] a continuation has not fed yet (None: a prompt, more tokens or rows, or a cache
        that takes its prompt its own way): the step that feeds it may be a decode run's."""
        cache = self.cache
        if not self.continues or cache is None or state.input_ids.shape[0] != 1 or awaiting_prompt(cache):
            return None
        tokens = continuation(state.input_ids, state.mask, cache)
        return tokens if tokens.shape[1] == 1 and bool(state.mask[0, -1]) else None

    def _greedy_steps(self, state: GenerationState, first: torch.Tensor | None = None) -> Step:
        """(token [1], logits [1, V]) pairs from greedy runs, many steps per C call (DecodeRun.greedy), until the
        loop stops taking them; returns (greedy runs off) where they do not apply. Each pair is what steps() would
        have yielded; the run counts as fed only the tokens before the last one the loop took. The first step
        feeds `first` [1, 1] when nothing was generated yet (a continuation's one new token), else the last token
        generated."""
        eos, keep = self.greedy
        model = self.model
        forms = model.fast_path is not None and model.fast_path.greedy_loop(model)  # embedding, head: C loop's
        while self.runs and forms:
            ids = first if state.count == 0 else state.generated[:, state.count - 1 : state.count]
            run = self._run
            if run is not None and run.full:
                self._close_run()
                run = None
            if run is None:
                run = self._start_run(ids, state)
                if run is None:
                    break
            base, k = run.steps, min(run.capacity - run.steps, state.generated.shape[1] - state.count)
            bad = None
            try:
                tokens, logits = run.greedy(model, int(ids[0, 0]), k, eos, keep)
            except NotImplementedError:
                if run.steps == 0:  # nothing fed: let go (the step-by-step path feeds the cache itself)
                    self.abandon()
                break
            except NonFiniteLogits as e:  # the tokens chosen before it first, then the step's error, as greedy_next's
                tokens, logits, bad = e.tokens, e.logits, e
            for i in range(tokens.shape[0]):
                run.steps = base + i + 1  # what the loop took so far was fed: the tokens before this one
                yield tokens[i : i + 1], logits[i : i + 1] if keep else logits
            if bad is not None:
                greedy_next(bad.row[None], f"generation step {state.count + 1}: ")  # raises GenerationError
                raise AssertionError("hc_decode_steps reported a finite row as not finite")
        self.greedy = None

    def _start_run(self, ids: torch.Tensor, state: GenerationState, h: torch.Tensor | None = None):
        """A decode run from the cache's state, its first step's tokens `ids` [B, 1]; None (runs off) where they do
        not apply: no cache (the recompute oracle), compiled, a model whose body is not embed -> layers -> head, or
        see DecodeRun.start. h: model.embed(ids), when the caller has it."""
        model, run = self.model, None
        body = getattr(type(model), "forward_block", None) is _BODY
        fast = model.fast_path
        if fast is not None and self.cache is not None and self.decode == model.forward_block and body:
            capacity = min(fast.run_tokens, state.generated.shape[1] - state.count)
            run = fast.start_run(model, self.cache, capacity, ids, model.embed(ids) if h is None else h)
        if run is None:
            self.runs = False
        self._run = run
        return run

    def _run_step(self, ids: torch.Tensor, state: GenerationState) -> torch.Tensor | None:
        """Logits [B, V] of a decode run's step (accel/runs/decode_run.py: the cache's bookkeeping once per run), or
        None where runs do not apply (then every later step goes step by step too)."""
        model, run = self.model, self._run
        if run is not None and run.full:
            self._close_run()
            run = None
        h = model.embed(ids)
        if run is None and self._start_run(ids, state, h) is None:
            return None
        return model.head(self._run.step(ids, h))[:, -1]

    def _close_run(self) -> None:
        """Feed the open run's tokens to the cache."""
        run, self._run = self._run, None
        if run is not None:
            run.finish()

    def abandon(self) -> None:
        """The generation failed: let go of the cache without feeding an open run's tokens (it keeps what it held
        when that run started)."""
        run, self._run = self._run, None
        if run is not None:
            run.abandon()

    def finish(self, out: Any, state: GenerationState) -> dict[str, Any] | None:
        self._close_run()
        return None


class PrefixSource(DecodeSource):
    """Decoding from the cache a `PrefixStore` prepared; on finish the store admits the request's end state."""

    def __init__(self, model: HybridLM, store: Any, state: GenerationState, cache_config, prefill_chunk_size) -> None:
        cache, self.request = store.prepare(model, state.input_ids, state.mask, cache_config)
        super().__init__(model, cache, None, prefill_chunk_size, continues=True)
        self.store = store

    def finish(self, out: Any, state: GenerationState) -> dict[str, Any] | None:
        self._close_run()
        return self.store.finish(self.model, out, self.request)
