"""Speculative (assisted) decoding for any family, hybrids and pure-recurrent models included. Greedy.

Each round the draft model proposes r <= k tokens one step at a time, the target verifies [last, d1..dr] in one
block, and the longest prefix where the draft agrees with the target's argmax is accepted, plus the target's own
next token. Both caches then roll back to the accepted prefix:
- "crop": when every layer can rewind r tokens exactly (full attention, recurrent layers with `checkpoints >= r`;
  the caches are built with `{"recurrent": {"checkpoints": k}}` for this), `cache.crop(n)`;
- "recompute": otherwise (sliding / chunked / evicting attention keeps too little to rewind), a snapshot taken
  before the round is restored and the accepted tokens are fed again.
The output is the target's plain greedy decoding (the same tokens), only with fewer target calls.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from hybridcache.cache import Cache, CacheConfigError
from hybridcache.cache.core.sequence import token_fingerprint
from hybridcache.generation.sampling import check_finite, greedy_next
from hybridcache.generation.sources.cached import DEFAULT_PREFILL_CHUNK, GenerationState
from hybridcache.models.core.base import GenerationError


def with_checkpoints(cache_config: Mapping[str, Any] | None, k: int) -> dict[str, Any]:
    """`cache_config` with recurrent layers keeping at least k checkpoints (so they can rewind a rejected draft)."""
    if cache_config is not None and not isinstance(cache_config, Mapping):
        raise CacheConfigError(f"a cache config must be a mapping (or None), got {type(cache_config).__name__}")
    config = dict(cache_config or {})
    recurrent = config.get("recurrent") or {}
    have = recurrent.get("checkpoints", 0) if isinstance(recurrent, Mapping) else "?"
    if isinstance(have, bool) or not isinstance(have, (int, type(None))):
        raise CacheConfigError(
            f"cache config: recurrent must be a mapping with an integer 'checkpoints', got {recurrent!r}"
        )
    recurrent = dict(recurrent)
    recurrent["checkpoints"] = max(have or 0, k)
    config["recurrent"] = recurrent
    return config


def rollback_mode(cache: Cache, r: int) -> str:
    """ "crop" when every layer can rewind the last r columns exactly, else "recompute"."""
    for layer in cache.layers:
        if layer.kind == "recurrent" and layer.spec.checkpoints < r:
            return "recompute"
        if layer.kind == "attention" and getattr(layer, "evicts", True):
            return "recompute"
    return "crop"


class _Rollback:
    """Feeds blocks to one model's cache and rolls it back to a prefix, by crop or by snapshot + recompute."""

    def __init__(self, model, cache: Cache, window: int) -> None:
        self.model, self.cache, self.mode = model, cache, rollback_mode(cache, window)
        self.snap = None

    def mark(self) -> None:
        """The point a later `keep` may return to (a snapshot only when rollback recomputes)."""
        self.start = self.cache.columns
        self.snap = self.cache.snapshot() if self.mode == "recompute" else None

    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.run_block(ids, self.cache, None)

    def keep(self, fed: torch.Tensor, keep: int) -> None:
        """The cache was fed `fed` [B, F] since `mark`; keep its first `keep` columns (feeding more if keep > F)."""
        f = fed.shape[1]
        if keep > f:
            raise AssertionError("keep beyond what was fed")
        if keep == f:
            return
        if self.mode == "crop":
            self.cache.crop(self.start + keep)
            return
        self.cache.restore(self.snap)
        if keep:
            self.feed(fed[:, :keep])


def _prefill(model, cache: Cache, ids: torch.Tensor, mask: torch.Tensor, chunk: int) -> torch.Tensor:
    for i in range(0, ids.shape[1], chunk):
        valid = mask[:, i : i + chunk]
        logits = model.run_block(ids[:, i : i + chunk], cache, None if bool(valid.all()) else valid, last_only=True)
    return logits[:, -1]


class SpeculativeSource:
    """Greedy speculative decoding as a token source of the generation loop (generation/sources/cached.py): each round
    yields the
    accepted draft tokens and the target's own next token, with the target's logits for each."""

    def __init__(
        self,
        model,
        draft_model,
        num_draft_tokens: int,
        cache_config: Mapping[str, Any] | None = None,
        draft_cache_config: Mapping[str, Any] | None = None,
        prefill_chunk_size: int | None = None,
    ) -> None:
        self.model, self.draft_model, self.k, self.chunk_size = model, draft_model, num_draft_tokens, prefill_chunk_size
        self.cache_config, self.draft_cache_config = cache_config, draft_cache_config
        self.cache = self.draft = None
        self.stats: dict[str, Any] = {}

    def steps(self, choose, state: GenerationState):
        """`choose` is not used: the target's argmax verifies the draft (greedy only)."""
        model, draft_model, k, input_ids = self.model, self.draft_model, self.k, state.input_ids
        batch, max_new = input_ids.shape[0], state.generated.shape[1]
        self.started = time.perf_counter()
        self.cache = target = model.make_cache(batch, with_checkpoints(self.cache_config, k))
        self.draft = draft = draft_model.make_cache(batch, with_checkpoints(self.draft_cache_config, k))
        chunk = self.chunk_size or min(input_ids.shape[1], DEFAULT_PREFILL_CHUNK)
        logits = _prefill(model, target, input_ids, state.mask, chunk)
        _prefill(draft_model, draft, input_ids.to(draft_model.device), state.mask.to(draft_model.device), chunk)
        t_roll, d_roll = _Rollback(model, target, k), _Rollback(draft_model, draft, k)
        stats = self.stats = {
            "rounds": 0,
            "drafted": 0,
            "accepted": 0,
            "target_calls": 1,
            "draft_calls": 1,
            "rollback": {"target": t_roll.mode, "draft": d_roll.mode},
        }
        last = greedy_next(logits, "generation step 1: ")  # [B]
        yield last, logits
        while True:  # the loop stops this generator after its last token
            r = min(k, max_new - state.count - 1)
            d_roll.mark()
            proposal, token = [], last
            for _ in range(r):  # the draft proposes r tokens, one step each
                token = greedy_next(draft_model.run_block(token[:, None].to(draft_model.device), draft, None)[:, -1])
                proposal.append(token.to(input_ids.device))
                stats["draft_calls"] += 1
            block = torch.stack([last, *proposal], dim=1)  # [B, r + 1]
            t_roll.mark()
            verify = t_roll.feed(block)  # [B, r + 1, V]
            stats["target_calls"] += 1
            best = verify.argmax(-1)  # [B, r + 1]: the target's greedy choice after each block token
            agree = (block[:, 1:] == best[:, :r]).long().cumprod(1).sum(1)  # [B] accepted per row
            live = ~state.done
            a = int(agree[live].min()) if bool(live.any()) else r
            stats["rounds"] += 1
            stats["drafted"] += r
            stats["accepted"] += a
            t_roll.keep(block, a + 1)  # the target keeps last, d1..da
            fed = block[:, :r].to(draft_model.device)  # the draft was fed last, d1..d_{r-1}
            if a + 1 <= r:
                d_roll.keep(fed, a + 1)
            else:  # everything accepted: the draft has not seen the last accepted token yet
                draft_model.run_block(block[:, r:].to(draft_model.device), draft, None, last_only=True)
                stats["draft_calls"] += 1
            for j in range(
                a + 1
            ):  # the target's own choices: not from logits that are not finite (generation/sampling.py)
                check_finite(verify[:, j].gather(-1, best[:, j, None])[:, 0], f"generation step {state.count + 1}: ")
                yield best[:, j], verify[:, j]
            last = best[:, a]

    def finish(self, out, state: GenerationState) -> dict[str, Any]:
        """Both caches remember the tokens they hold (a crop forgets the ids; a continuation check needs them)."""
        sequences, new = out.sequences, state.count
        held = torch.cat([state.mask, torch.ones_like(sequences[:, state.mask.shape[1] + 1 :], dtype=torch.bool)], 1)
        replaced = bool(state.done.any())  # rows past their stop show padding the caches never saw
        for cache, device in ((self.cache, self.model.device), (self.draft, self.draft_model.device)):
            if cache.seq.fingerprint is None and not replaced:
                pos = torch.where(held, held.long().cumsum(1) - 1, -1)
                cache.seq.fingerprint = token_fingerprint(sequences[:, :-1], pos).to(device)
        stats = self.stats
        stats["acceptance_rate"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else 0.0
        stats["tokens_per_target_call"] = new / max(1, stats["target_calls"] - 1)
        stats["seconds"] = time.perf_counter() - self.started
        return stats


class EarlyExitDraft(torch.nn.Module):
    """A self-speculative draft: the target's embedding, its first `num_layers` decoder layers and its head (the
    weights are shared, nothing is copied). Cheaper than the target by about num_layers / total; needs no second
    checkpoint, only the same tokenizer by construction."""

    def __init__(self, target, num_layers: int) -> None:
        super().__init__()
        total = len(target.decoder_layers)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
            raise GenerationError(f"num_layers must be in [1, {total}], got {num_layers!r}")
        own = len(target.native_layers())
        if num_layers > own:  # Gemma 4's KV-shared layers: no entry of their own, they read a writer's K/V
            raise GenerationError(
                f"{target.family}: only its first {own} decoder layers hold cache entries (the others read another "
                f"layer's keys and values); an early-exit draft takes at most {own} layers, got {num_layers}"
            )
        self.target, self.num_layers = target, num_layers
        self.config, self.family = target.config, f"{target.family}[:{num_layers}]"

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["target"], name)

    @property
    def decoder_layers(self):
        return self.target.decoder_layers[: self.num_layers]

    def native_layers(self):
        return self.target.native_layers()[: self.num_layers]

    def make_cache(self, batch_size: int = 1, cache_config=None, max_length=None) -> Cache:
        return Cache.build(self.native_layers(), batch_size, cache_config, max_length, device=self.target.device)

    def run_block(self, input_ids, cache, valid=None, step=None, check=True, last_only=False):
        cache.begin_block(valid, input_ids.shape[1], check=check, ids=input_ids)
        try:
            block = cache.current_block
            h = self.target.layers_forward(self.target.embed(input_ids), cache.entries, block, self.decoder_layers)
            logits = self.target.head(h[:, -1:] if last_only else h)
        except BaseException:
            cache.abort_block()
            raise
        cache.end_block()
        return logits
