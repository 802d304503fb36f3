"""Where speculative decoding's proposals come from: a draft model (its own cache, rolled back with the target's), or
prompt lookup (n-gram matching in the sequence itself; no model, no cache).

A drafter proposes `r` tokens per row after the last accepted one, with the probability it drew each from (`q`
[B, r, V]; None: the proposals are deterministic, a one-hot q), then hears how many the round kept.
"""

from __future__ import annotations

import torch

from hybridcache.cache import Cache
from hybridcache.generation.sampling import greedy_next, sampling_probs
from hybridcache.models.core.base import GenerationError


def prefill(model, cache: Cache, ids: torch.Tensor, mask: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed a prompt [B, T] (mask [B, T]) in chunks; the last column's logits [B, V]."""
    for i in range(0, ids.shape[1], chunk):
        valid = mask[:, i : i + chunk]
        logits = model.feed_block(ids[:, i : i + chunk], cache, None if bool(valid.all()) else valid, last_only=True)
    return logits[:, -1]


class PromptLookupDraft:
    """Prompt-lookup drafting (Saxena 2023; HF's `prompt_lookup_num_tokens`, vLLM's ngram speculator): the last n
    tokens of a row (n from `max_ngram` down to `min_ngram`) are looked up earlier in the same row, prompt and
    generated text alike, and the tokens that followed their latest earlier occurrence are proposed. Pays where
    the output repeats its input (summaries, code edits, extraction); proposes nothing where no n-gram recurs.
    Pass it as `generate(..., draft_model=PromptLookupDraft())`."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        for name, v in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise GenerationError(f"PromptLookupDraft: {name} must be a positive integer, got {v!r}")
        if min_ngram > max_ngram:
            raise GenerationError(f"PromptLookupDraft: min_ngram ({min_ngram}) exceeds max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def __repr__(self) -> str:
        return f"PromptLookupDraft(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

    def lookup(self, tokens: torch.Tensor, r: int) -> torch.Tensor:
        """Up to r tokens [<= r] that followed the latest earlier occurrence of the longest recurring suffix of
        `tokens` [L] (one row's real tokens), or none."""
        length = tokens.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = tokens.unfold(0, n, 1)[:-1]  # [L - n, n]: every earlier n-gram (not the suffix itself)
            hits = (windows == tokens[-n:]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return tokens[start : start + r]
        return tokens[:0]


class LookupDrafter:
    """A PromptLookupDraft at work in one generation: proposals read from the loop's sequences."""

    rollback = "none"

    def __init__(self, spec: PromptLookupDraft, state) -> None:
        self.spec, self.state = spec, state

    def start(self, input_ids: torch.Tensor, mask: torch.Tensor, chunk: int) -> None:
        pass

    def propose(self, last: torch.Tensor, r: int, probs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, r'] proposals (r' <= r: the longest any row found; shorter rows are padded with their last token,
        which the target verifies like any proposal) and q = None (deterministic proposals)."""
        seqs = self.state.sequences()  # [B, T + count]: the prompt (left-padded) and the tokens so far
        real = torch.cat([self.state.mask, torch.ones_like(seqs[:, self.state.mask.shape[1] :], dtype=torch.bool)], 1)
        found = [self.spec.lookup(row[keep], r) for row, keep in zip(seqs, real, strict=True)]
        width = max(f.shape[0] for f in found)
        out = last[:, None].repeat(1, width)
        for i, f in enumerate(found):
            out[i, : f.shape[0]] = f
        return out, None

    def keep(self, block: torch.Tensor, r: int, a: int) -> None:
        pass


class ModelDrafter:
    """A draft model (any hybridcache model or an EarlyExitDraft with the target's vocabulary) proposing one step at
    a time from its own cache, which rolls back to what the round kept."""

    def __init__(self, draft_model, cache: Cache, rollback_factory) -> None:
        self.model, self.cache = draft_model, cache
        self.roll = rollback_factory(draft_model, cache)
        self.rollback = self.roll.mode
        self.calls = 0

    def start(self, input_ids: torch.Tensor, mask: torch.Tensor, chunk: int) -> None:
        prefill(self.model, self.cache, input_ids.to(self.model.device), mask.to(self.model.device), chunk)
        self.calls += 1

    def propose(self, last: torch.Tensor, r: int, probs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """r proposals [B, r], greedy (q None) or sampled from the draft's own distribution `probs(logits)` (q
        [B, r, V])."""
        self.roll.mark()
        tokens, qs, token = [], [], last
        for _ in range(r):
            logits = self.model.feed_block(token[:, None].to(self.model.device), self.cache, None)[:, -1]
            self.calls += 1
            if probs is None:
                token = greedy_next(logits).to(last.device)
            else:
                q = probs(logits.to(last.device))  # [B, V]
                token = probs.sample(q)
                qs.append(q)
            tokens.append(token)
        proposal = torch.stack(tokens, 1) if tokens else last[:, None][:, :0]  # [B, r]
        return proposal, (torch.stack(qs, 1) if qs else None)

    def keep(self, block: torch.Tensor, r: int, a: int) -> None:
        """The round fed the draft last, d1..d_{r-1} and kept a + 1 of the target's columns (last, d1..da)."""
        fed = block[:, :r].to(self.model.device)
        if a + 1 <= r:
            self.roll.keep(fed, a + 1)
        else:  # everything accepted: the draft has not seen the last accepted token yet
            self.model.feed_block(block[:, r:].to(self.model.device), self.cache, None, last_only=True)
            self.calls += 1


class DraftProbs:
    """The sampler's distribution for drafts and verification: `probs(logits)` with the request's temperature /
    top-k / top-p, and `sample(q)` from the request's generator."""

    def __init__(self, temperature: float, top_k, top_p, generator) -> None:
        self.temperature, self.top_k, self.top_p, self.generator = temperature, top_k, top_p, generator

    def __call__(self, logits: torch.Tensor, where: str = "") -> torch.Tensor:
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p, where)

    def sample(self, q: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(q, 1, generator=self.generator).squeeze(-1)

    def uniform(self, shape: tuple[int, ...], device) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=device)
