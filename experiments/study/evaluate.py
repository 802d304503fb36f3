"""What experiment=study measures for each cache strategy (a named cache-config mapping), on the same text.

- `teacher_forced`: every strategy reads the same document block by block (`model(ids, cache=cache)` with the
  strategy's own cache, so its pattern and storage apply between blocks exactly as in generation), in lockstep with
  the native strategy. Per position: the negative log-likelihood of the next token (perplexity), KL(native ||
  strategy) of the next-token distributions, and whether both argmaxes agree. At each context length L the cache is
  snapshotted and the strategy continues the document greedily for N tokens (`hc.generate(cache=...)`), which is
  compared with native's continuation, then restored.
- `continuation` (kvpress's protocol, the one a compress-after-prefill strategy can be measured with): the first L
  tokens as ONE block (a cache with schedule prefill compresses at its end), then the next N tokens teacher-forced in
  one block; NLL, KL from native and top-1 agreement on those N predictions, for every strategy alike.
- `passkey` and `ruler_trial`: greedy `hc.generate` on a synthetic prompt (experiments/long_context/ruler.py for
  RULER's tasks),
  scored by the key appearing in the answer / RULER's metric.

Only one block of native log-probabilities is alive at a time, so memory stays at a few blocks of [T, V] logits
however long the document is (Gemma's vocabulary is 262k).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import hybridcache as hc
from experiments.core import mqar
from experiments.long_context import ruler
from experiments.whole_model.byte_counts import kind_bytes
from hybridcache.cache import Cache


@dataclass
class Strategy:
    """One named cache config and everything measured for it."""

    name: str
    config: dict[str, Any]
    cache: Cache | None = None
    nll: list[torch.Tensor] = field(default_factory=list)  # per block [T]
    kl: list[torch.Tensor] = field(default_factory=list)  # per block [T]
    top1: list[torch.Tensor] = field(default_factory=list)  # per block [T] bool
    greedy: dict[int, list[int]] = field(default_factory=dict)  # context length -> N greedy tokens
    passkey: list[dict[str, Any]] = field(default_factory=list)
    nbytes_after: int = 0
    nbytes_after_split: dict[str, int] = field(default_factory=dict)  # {"kv", "state"}: the same bytes by part


def block_edges(total: int, block: int, lengths: list[int]) -> list[int]:
    """Block boundaries: every `block` tokens, plus every context length (so each length ends a block)."""
    return sorted({*range(0, total, block), *lengths, total})


@torch.no_grad()
def teacher_forced(
    model,
    doc: list[int],
    strategies: list[Strategy],
    lengths: list[int],
    block: int,
    greedy_tokens: int,
    advance: Callable[[], None],
) -> None:
    """Feed `doc` through every strategy's cache in lockstep; strategies[0] is the native one (KL reference)."""
    ids = torch.tensor([doc], device=model.device)
    target = ids[0, 1:]
    for s in strategies:
        s.cache = model.make_cache(1, s.config)
    edges = block_edges(len(doc), block, lengths)
    for start, end in zip(edges, edges[1:]):
        native_logp = None
        for s in strategies:
            logits = model(ids[:, start:end], cache=s.cache)[0].float()  # [T, V]
            logp = torch.log_softmax(logits, dim=-1)
            del logits
            n = min(end, len(doc) - 1) - start  # positions that have a next token
            s.nll.append(-logp[:n].gather(1, target[start : start + n, None])[:, 0])
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
        s.nbytes_after_split = held_by_part(s.cache)
        s.cache = None


def held_by_part(cache: Cache) -> dict[str, int]:
    """{"kv": ..., "state": ...}: the bytes the Cache holds (`cache.nbytes()`), by the kind of its cache layers."""
    return kind_bytes(cache.layers, lambda layer: layer.nbytes())


def generate(model, ids: torch.Tensor, **kwargs):
    """hc.generate, or an HF model's own greedy loop with our cache under engine=hf (experiments/hf/model.py)."""
    own = getattr(model, "hf_generate", None)
    return own(ids, **kwargs) if own is not None else hc.generate(model, ids, **kwargs)


def continue_greedily(model, prefix: torch.Tensor, last_logp: torch.Tensor, cache: Cache, n: int) -> list[int]:
    """n greedy tokens after `prefix` from a cache that has seen it (left exactly as it was afterwards)."""
    first = int(last_logp.argmax())
    if n == 1:
        return [first]
    snap = cache.snapshot()
    try:
        seq = torch.cat([prefix, torch.tensor([[first]], device=prefix.device)], dim=1)
        out = generate(model, seq, max_new_tokens=n - 1, cache=cache)
        return [first, *out.sequences[0, prefix.shape[1] + 1 :].tolist()]
    finally:
        cache.restore(snap)


@dataclass
class Continuation:
    """One strategy under kvpress's protocol, per context length L: N teacher-forced predictions after an L-token
    prompt fed as one block."""

    name: str
    config: dict[str, Any]
    nll: dict[int, torch.Tensor] = field(default_factory=dict)  # L -> [N]
    kl: dict[int, torch.Tensor] = field(default_factory=dict)  # L -> [N]
    top1: dict[int, torch.Tensor] = field(default_factory=dict)  # L -> [N] bool
    greedy: dict[int, list[int]] = field(default_factory=dict)  # L -> greedy tokens after the prompt
    nbytes_after_prompt: dict[int, int] = field(default_factory=dict)
    nbytes_after_prompt_split: dict[int, dict[str, int]] = field(default_factory=dict)  # L -> {"kv", "state"}


@torch.no_grad()
def continuation(
    model,
    doc: list[int],
    strategies: list[Continuation],
    lengths: list[int],
    n: int,
    greedy_tokens: int,
    greedy_for: set[str],
    advance: Callable[[], None],
) -> None:
    """kvpress's protocol for every strategy (strategies[0]: native, the KL reference): prompt doc[:L] in one block,
    then doc[L:L+n] in one block, scored on predicting doc[L+1:L+n+1]. Greedy tokens after the prompt for the
    strategies in `greedy_for` (the compress-after-prefill ones, whose blockwise greedy would mean nothing)."""
    ids = torch.tensor([doc], device=model.device)
    for L in lengths:
        if L + n + 1 > len(doc):
            raise ValueError(f"continuation needs {L + n + 1} tokens, the document has {len(doc)}")
        target = ids[0, L + 1 : L + n + 1]
        native_logp = None
        for s in strategies:
            cache = model.make_cache(1, s.config)
            last = model.feed_block(ids[:, :L], cache, last_only=True)[0, -1].float()  # [V]; compressed after
            s.nbytes_after_prompt[L] = cache.nbytes()
            s.nbytes_after_prompt_split[L] = held_by_part(cache)
            if s.name in greedy_for and greedy_tokens > 0:
                s.greedy[L] = continue_greedily(model, ids[:, :L], last, cache, greedy_tokens)
            logp = torch.log_softmax(model(ids[:, L : L + n], cache=cache)[0].float(), dim=-1)  # [n, V]
            s.nll[L] = -logp.gather(1, target[:, None])[:, 0]
            if native_logp is None:
                native_logp = logp
            s.kl[L] = (native_logp.exp() * (native_logp - logp)).sum(-1).clamp_min(0)
            s.top1[L] = native_logp.argmax(-1) == logp.argmax(-1)
            advance()
        del native_logp


def ruler_trial(
    model, tokenizer, sample: ruler.RulerSample, config: dict[str, Any], chunk: int, max_new_tokens: int | None
) -> dict[str, Any]:
    """One RULER prompt under a cache config: the greedy answer and its score under the task's RULER metric."""
    ids = torch.tensor([sample.ids], device=model.device)
    new = min(sample.max_new_tokens, max_new_tokens or sample.max_new_tokens)
    out = generate(model, ids, max_new_tokens=new, cache_config=config, prefill_chunk_size=chunk, output_logits=False)
    answer = tokenizer.decode(out.sequences[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    return {
        "task": sample.task,
        "length": sample.length,
        "depth": sample.depth,
        "answers": sample.answers,
        "prediction": answer,
        "score": ruler.score(sample.task, answer, sample.answers),
    }


def passkey(model, tokenizer, prompt, config: dict[str, Any], block: int) -> dict[str, Any]:
    """One passkey trial under a cache config: the greedy answer and whether it holds the key (`block`: the prefill
    chunk; the whole prompt for a compress-after-prefill strategy)."""
    ids = torch.tensor([prompt.ids], device=model.device)
    out = generate(
        model,
        ids,
        max_new_tokens=prompt.answer_tokens,
        cache_config=config,
        prefill_chunk_size=block,
        output_logits=False,
    )
    answer = tokenizer.decode(out.sequences[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    return {
        "length": len(prompt.ids),
        "depth": prompt.depth,
        "distance": prompt.distance,
        "key": prompt.key,
        "answer": answer,
        "correct": prompt.key in answer,
    }


@torch.no_grad()
def mqar_trial(
    model, prompt: mqar.Prompt, config: dict[str, Any], block: int, one_block_prompt: bool
) -> dict[str, Any]:
    """One MQAR example under a cache config, scored teacher-forced as Zoology does: the whole example is read in
    blocks of `block` (the cache's pattern and storage apply between blocks), or, for a compress-after-prefill
    strategy, the pairs as one block (its prompt) and the queries as a second. A query is recalled when every id of
    its value is the argmax prediction."""
    ids = torch.tensor([prompt.ids], device=model.device)
    cache = model.make_cache(1, config)
    if one_block_prompt:
        model.feed_block(ids[:, : prompt.context], cache, last_only=True)
        edges = [prompt.context, len(prompt.ids)]
    else:
        edges = block_edges(len(prompt.ids), block, [])
    preds = [torch.zeros(edges[0], dtype=torch.long, device=model.device)]  # the prompt block's: never scored
    for start, end in zip(edges, edges[1:]):
        preds.append(model(ids[:, start:end], cache=cache)[0].argmax(-1))  # [T]
    pred = torch.cat(preds).tolist()  # pred[i] predicts ids[i + 1]
    queries = [
        {"distance": distance, "correct": pred[at - 1 : at - 1 + len(value)] == value}
        for at, value, distance in prompt.answers
    ]
    return {
        "pairs": prompt.pairs,
        "length": len(prompt.ids),
        "queries": queries,
        "accuracy": sum(q["correct"] for q in queries) / len(queries),
    }


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
