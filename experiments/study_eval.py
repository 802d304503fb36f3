"""What experiment=study measures for each cache strategy (a named cache-config mapping), on the same text.

- `teacher_forced`: every strategy reads the same document block by block (`model(ids, cache=cache)` with the
  strategy's own cache, so its pattern and storage apply between blocks exactly as in generation), in lockstep with
  the native strategy. Per position: the negative log-likelihood of the next token (perplexity), KL(native ||
  strategy) of the next-token distributions, and whether both argmaxes agree. At each context length L the cache is
  snapshotted and the strategy continues the document greedily for N tokens (`hc.generate(cache=...)`), which is
  compared with native's continuation, then restored.
- `passkey`: greedy `hc.generate` on synthetic passkey prompts; correct when the key appears in the answer.

Only one block of native log-probabilities is alive at a time, so memory stays at a few blocks of [T, V] logits
however long the document is (Gemma's vocabulary is 262k).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import hybridcache as hc
from hybridcache.cache import Cache


@dataclass
class Strategy:
    """One named cache config and everything measured for it."""

    name: str
    config: dict[str, Any]
    cache: Cache | None = None
    nll: list[torch.Tensor] = field(default_factory=list)        # per block [T]
    kl: list[torch.Tensor] = field(default_factory=list)         # per block [T]
    top1: list[torch.Tensor] = field(default_factory=list)       # per block [T] bool
    greedy: dict[int, list[int]] = field(default_factory=dict)   # context length -> N greedy tokens
    passkey: list[dict[str, Any]] = field(default_factory=list)
    nbytes_after: int = 0


def block_edges(total: int, block: int, lengths: list[int]) -> list[int]:
    """Block boundaries: every `block` tokens, plus every context length (so each length ends a block)."""
    return sorted({*range(0, total, block), *lengths, total})


@torch.no_grad()
def teacher_forced(model, doc: list[int], strategies: list[Strategy], lengths: list[int], block: int,
                   greedy_tokens: int, advance: Callable[[], None]) -> None:
    """Feed `doc` through every strategy's cache in lockstep; strategies[0] is the native one (KL reference)."""
    ids = torch.tensor([doc], device=model.device)
    target = ids[0, 1:]
    for s in strategies:
        s.cache = model.make_cache(1, s.config)
    edges = block_edges(len(doc), block, lengths)
    for start, end in zip(edges, edges[1:]):
        native_logp = None
        for s in strategies:
            logits = model(ids[:, start:end], cache=s.cache)[0].float()       # [T, V]
            logp = torch.log_softmax(logits, dim=-1)
            del logits
            n = min(end, len(doc) - 1) - start                                  # positions that have a next token
            s.nll.append(-logp[:n].gather(1, target[start:start + n, None])[:, 0])
            if native_logp is None:
                native_logp = logp
                s.kl.append(torch.zeros(n))
                s.top1.append(torch.ones(n, dtype=torch.bool))
            else:
                kl = (native_logp[:n].exp() * (native_logp[:n] - logp[:n])).sum(-1).clamp_min(0)
                s.kl.append(kl)
                s.top1.append(native_logp[:n].argmax(-1) == logp[:n].argmax(-1))
            if end in lengths and greedy_tokens > 0:
                s.greedy[end] = continue_greedily(model, ids[:, :end], logp[-1], s.cache, greedy_tokens)
            del logp
            advance()
        del native_logp
    for s in strategies:
        s.nbytes_after = s.cache.nbytes()
        s.cache = None


def continue_greedily(model, prefix: torch.Tensor, last_logp: torch.Tensor, cache: Cache, n: int) -> list[int]:
    """n greedy tokens after `prefix` from a cache that has seen it (left exactly as it was afterwards)."""
    first = int(last_logp.argmax())
    if n == 1:
        return [first]
    snap = cache.snapshot()
    try:
        seq = torch.cat([prefix, torch.tensor([[first]], device=prefix.device)], dim=1)
        out = hc.generate(model, seq, max_new_tokens=n - 1, cache=cache)
        return [first, *out.sequences[0, prefix.shape[1] + 1:].tolist()]
    finally:
        cache.restore(snap)


def passkey(model, tokenizer, prompt, config: dict[str, Any], block: int) -> dict[str, Any]:
    """One passkey trial under a cache config: the greedy answer and whether it holds the key."""
    ids = torch.tensor([prompt.ids], device=model.device)
    out = hc.generate(model, ids, max_new_tokens=prompt.answer_tokens, cache_config=config,
                      prefill_chunk_size=block)
    answer = tokenizer.decode(out.sequences[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    return {"length": len(prompt.ids), "depth": prompt.depth, "distance": prompt.distance, "key": prompt.key,
            "answer": answer, "correct": prompt.key in answer}


def prefix_mean(chunks: list[torch.Tensor], positions: int) -> float:
    """Mean of the first `positions` per-position values (a context length L has L-1 predictions)."""
    values = torch.cat(chunks)[:positions].double()
    return float(values.mean()) if values.numel() else float("nan")


def prefix_max(chunks: list[torch.Tensor], positions: int) -> float:
    values = torch.cat(chunks)[:positions].double()
    return float(values.max()) if values.numel() else float("nan")


def agreement(ours: list[int], native: list[int]) -> tuple[float, int | None]:
    """Share of the N steps before the first divergence from native, and that step (None: never diverges)."""
    for i, (a, b) in enumerate(zip(ours, native)):
        if a != b:
            return i / len(native), i
    return 1.0, None
