"""Speculative (assisted) decoding for any family, hybrids and pure-recurrent models included; greedy or sampled.

Each round a drafter (drafts.py: a draft model one step at a time, or prompt lookup) proposes r <= k tokens, the
target verifies [last, d1..dr] in one block, and the longest prefix the target accepts is kept, plus one token of
the target's own: greedy, where the draft agrees with the target's argmax; sampled, by speculative sampling's
accept / resample rule (sampled_round). Both caches then roll back to the accepted prefix:
- "crop": when every layer can rewind r tokens exactly (full attention; sliding / chunked / sink attention with
  `spare >= r`; recurrent layers with `rollback >= r`: the caches are built so by with_rollback), `cache.crop(n)`;
- "recompute": otherwise (presses and other evicting attention keep too little to rewind), a snapshot taken
  before the round is restored and the accepted tokens are fed again.
Greedy output is the target's plain greedy decoding (the same tokens); sampled output is an exact sample of the
target's sampling distribution (not the same draws as plain sampling), only with fewer target calls.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from hybridcache.cache import Cache, CacheConfigError
from hybridcache.cache.core.plan import resolve_plan
from hybridcache.cache.core.registry import get_layer_class
from hybridcache.cache.core.sequence import token_fingerprint
from hybridcache.generation.sampling import check_finite
from hybridcache.generation.sources.cached import DEFAULT_PREFILL_CHUNK, GenerationState
from hybridcache.generation.sources.drafts import DraftProbs, LookupDrafter, ModelDrafter, PromptLookupDraft, prefill
from hybridcache.models.core.base import GenerationError


def with_recurrent_rollback(cache_config: Mapping[str, Any] | None, k: int) -> dict[str, Any]:
    """`cache_config` with recurrent layers keeping k states back at least (`rollback: k`: they can rewind a draft)."""
    if cache_config is not None and not isinstance(cache_config, Mapping):
        raise CacheConfigError(f"a cache config must be a mapping (or None), got {type(cache_config).__name__}")
    config = dict(cache_config or {})
    recurrent = config.get("recurrent") or {}
    have = recurrent.get("rollback", 0) if isinstance(recurrent, Mapping) else "?"
    if isinstance(have, bool) or not isinstance(have, (int, type(None))):
        raise CacheConfigError(
            f"cache config: recurrent must be a mapping with an integer 'rollback', got {recurrent!r}"
        )
    recurrent = dict(recurrent)
    recurrent["rollback"] = max(have or 0, k)
    config["recurrent"] = recurrent
    return config


def with_rollback(model, cache_config: Mapping[str, Any] | None, k: int) -> dict[str, Any]:
    """`with_recurrent_rollback`, and every attention layer whose type keeps `spare` tokens (sliding, chunked, sink)
    keeping
    at least k of them, so both kinds can rewind a rejected draft by a crop. Set per layer (`layers: {i: ...}`), so
    a type that takes no `spare` (full, the presses) is left as configured. A draft that declares no native layers
    gets the rollback only."""
    config = with_recurrent_rollback(cache_config, k)
    if not callable(getattr(model, "native_layers", None)):
        return config
    plan = resolve_plan(model.native_layers(), config)
    entries = dict(config.get("layers") or {})
    for p in plan.layers:
        if p.kind != "attention" or "spare" not in get_layer_class(p.type).spec_cls.tunable_names():
            continue
        if p.spec.max_length is not None or p.spec.residual or p.spec.storage in ("kivi", "hf_quantized"):
            continue  # storage with slots of its own: rollback recomputes (check_spare)
        _add_spare(entries, p, k)
    if entries:
        config["layers"] = entries
    return config


def _add_spare(entries: dict, p, k: int) -> None:
    """Merge `spare: k` into the user's `layers:` entry for plan layer `p`: the one at its own address (3, "3" or
    "3.attention"), else, for a group member, the decoder layer's entry ({3: {attention: {...}}}); a new entry at
    its address where the user has none."""
    own = next((key for key in entries if str(key) == p.address), None)
    whole = next((key for key in entries if str(key) == str(p.index)), None) if p.member else None
    if own is None and whole is not None:
        entry = dict(entries[whole] or {})
        member = dict(entry.get(p.member) or {})
        member["spare"] = max(int(member.get("spare") or 0), k)
        entries[whole] = {**entry, p.member: member}
        return
    key = p.address if own is None else own
    entry = dict(entries.get(key) or {})
    entry["spare"] = max(int(entry.get("spare") or 0), k)
    entries[key] = entry


def rollback_mode(cache: Cache, r: int) -> str:
    """ "crop" when every layer can rewind the last r columns exactly, else "recompute"."""
    for layer in cache.layers:
        if layer.kind == "recurrent" and layer.spec.rollback < r:
            return "recompute"
        if layer.kind == "attention" and getattr(layer, "evicts", True) and layer.spec.rollback < r:
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
        return self.model.feed_block(ids, self.cache, None)

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


def sampled_round(
    p: torch.Tensor, q: torch.Tensor | None, proposal: torch.Tensor, probs: DraftProbs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's accept / resample step (Leviathan et al. 2023, Chen et al. 2023) for one round.

    p [B, r + 1, V]: the target's distributions after last, d1..dr; q [B, r, V] the draft's (None: deterministic
    proposals, a one-hot q); proposal [B, r]. Draft token j is accepted with probability min(1, p_j(d) / q_j(d));
    where it is rejected the token is drawn from max(0, p_j - q_j), renormalised; position r (every draft token
    accepted) is drawn from p_r. Returns (accepted [B]: the leading run of accepted drafts per row, tokens [B, r + 1]:
    position j's token, the draft where accepted, else the resample), each an exact sample of p_j given its prefix
    whichever position a round stops at (the stop depends only on earlier positions and on other rows)."""
    r = proposal.shape[1]
    d = proposal[..., None]  # [B, r, 1]
    p_d = p[:, :r].gather(-1, d)[..., 0]  # [B, r]
    q_d = q.gather(-1, d)[..., 0] if q is not None else torch.ones_like(p_d)
    accept = probs.uniform(p_d.shape, p_d.device) * q_d < p_d  # u < p / q, without dividing by a tiny q
    if q is None:
        q = torch.zeros_like(p[:, :r]).scatter_(-1, d, 1.0)
    residual = (p[:, :r] - q).clamp_(min=0)  # [B, r, V]
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p[:, :r])  # p == q: never rejected
    redraw = probs.sample(residual.reshape(-1, residual.shape[-1])).view(p_d.shape) if r else proposal
    tokens = torch.cat([torch.where(accept, proposal, redraw), probs.sample(p[:, r])[:, None]], 1)
    return accept.long().cumprod(1).sum(1), tokens


class SpeculativeSource:
    """Speculative decoding as a token source of the generation loop (generation/sources/cached.py): each round a
    drafter (a draft model, or PromptLookupDraft) proposes up to k tokens, the target verifies them in one block,
    and the round yields the kept tokens with the target's logits for each. Greedy: the target's argmax decides
    (the tokens of plain greedy decoding). Sampling: speculative sampling (sampled_round), an exact sample of the
    target's sampling distribution (temperature / top-k / top-p)."""

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

    def _drafter(self, state: GenerationState, batch: int):
        if isinstance(self.draft_model, PromptLookupDraft):
            return LookupDrafter(self.draft_model, state)
        config = with_rollback(self.draft_model, self.draft_cache_config, self.k)
        self.draft = self.draft_model.make_cache(batch, config)
        return ModelDrafter(self.draft_model, self.draft, lambda m, c: _Rollback(m, c, self.k))

    def steps(self, choose, state: GenerationState):
        """`choose` gives the first token; the rounds choose by the target's argmax (greedy) or by speculative
        sampling with the chooser's settings and generator (no logits processors: checked before)."""
        model, k, input_ids = self.model, self.k, state.input_ids
        batch, max_new = input_ids.shape[0], state.generated.shape[1]
        c = choose.chooser
        probs = DraftProbs(c.temperature, c.top_k, c.top_p, c.generator) if c.do_sample else None
        self.started = time.perf_counter()
        self.cache = target = model.make_cache(batch, with_rollback(model, self.cache_config, k))
        drafter = self._drafter(state, batch)
        chunk = self.chunk_size or min(input_ids.shape[1], DEFAULT_PREFILL_CHUNK)
        logits = prefill(model, target, input_ids, state.mask, chunk)
        drafter.start(input_ids, state.mask, chunk)
        t_roll = _Rollback(model, target, k)
        stats = self.stats = {
            "rounds": 0,
            "drafted": 0,
            "accepted": 0,
            "target_calls": 1,
            "rollback": {"target": t_roll.mode, "draft": drafter.rollback},
        }
        last = choose(logits)  # [B]
        yield last, logits
        while True:  # the loop stops this generator after its last token
            proposal, q = drafter.propose(last, min(k, max_new - state.count - 1), probs)  # [B, r], [B, r, V] | None
            r = proposal.shape[1]
            block = torch.cat([last[:, None], proposal.to(last.device)], dim=1)  # [B, r + 1]
            t_roll.mark()
            verify = t_roll.feed(block)  # [B, r + 1, V]
            stats["target_calls"] += 1
            where = f"generation step {state.count + 1}: "
            if probs is None:
                tokens = verify.argmax(-1)  # [B, r + 1]: the target's greedy choice after each block token
                agree = (block[:, 1:] == tokens[:, :r]).long().cumprod(1).sum(1)  # [B] accepted per row
            else:
                agree, tokens = sampled_round(probs(verify, where), q, proposal, probs)
            live = ~state.done
            a = int(agree[live].min()) if bool(live.any()) else r
            stats["rounds"] += 1
            stats["drafted"] += r
            stats["accepted"] += a
            t_roll.keep(block, a + 1)  # the target keeps last, d1..da
            drafter.keep(block, r, a)
            for j in range(a + 1):  # not from logits that are not finite (generation/sampling.py)
                if probs is None:
                    check_finite(verify[:, j].gather(-1, tokens[:, j, None])[:, 0], where)
                yield tokens[:, j], verify[:, j]
            last = tokens[:, a]

    def finish(self, out, state: GenerationState) -> dict[str, Any]:
        """Both caches remember the tokens they hold (a crop forgets the ids; a continuation check needs them)."""
        sequences, new = out.sequences, state.count
        held = torch.cat([state.mask, torch.ones_like(sequences[:, state.mask.shape[1] + 1 :], dtype=torch.bool)], 1)
        replaced = bool(state.done.any())  # rows past their stop show padding the caches never saw
        caches = [(self.cache, self.model.device)]
        if self.draft is not None:
            caches.append((self.draft, self.draft_model.device))
        for cache, device in caches:
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

    def feed_block(self, input_ids, cache, valid=None, step=None, check=True, last_only=False):
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
