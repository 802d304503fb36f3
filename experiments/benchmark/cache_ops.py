"""Cache operations in the benchmark: speculative decoding and prefix reuse
(hybridcache/generation/sources/speculative.py,
hybridcache/generation/sources/prefix.py), each measured against the same work without the operation.

Speculative: greedy, batch 1; the draft is the target's first `draft_layers` fraction of decoder layers
(`EarlyExitDraft`: no second checkpoint needed). Reports acceptance rate, tokens per target call, wall-clock
speed-up over plain greedy decoding, and whether the tokens are identical (they must be for exact caches).
Prefix reuse: `requests` prompts = one shared system prompt + a distinct user suffix, then each conversation's
second turn (its first output + a new suffix); with a store per policy vs without. Reports hit rate, prompt tokens
saved, bytes held and the speed-up; outputs must be identical.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import hybridcache as hc
from hybridcache.cache.core.plan import format_bytes
from hybridcache.generation.sources.prefix import PrefixStore
from hybridcache.generation.sources.speculative import EarlyExitDraft

DEFAULTS = {
    "prompt_tokens": 64,
    "new_tokens": 64,
    "num_draft_tokens": [2, 4],
    "draft_layers": 0.5,
    "requests": 6,
    "system_tokens": 96,
    "suffix_tokens": 16,
    "turn_new_tokens": 16,
    "block_size": 16,
    "max_bytes": 64 << 20,
}
SMOKE = {
    "prompt_tokens": 8,
    "new_tokens": 8,
    "num_draft_tokens": [2],
    "requests": 3,
    "system_tokens": 16,
    "suffix_tokens": 4,
    "turn_new_tokens": 4,
    "block_size": 8,
}


def _ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def speculative_rows(model, cache_config, s: dict[str, Any]) -> list[dict[str, Any]]:
    vocab, rows = model.vocab_size, []
    layers = max(1, round(len(model.decoder_layers) * float(s["draft_layers"])))
    draft = EarlyExitDraft(model, layers)
    ids = _ids(int(s["prompt_tokens"]), 1, vocab)
    new = int(s["new_tokens"])
    hc.generate(model, ids, max_new_tokens=2, cache_config=cache_config)  # warm-up
    plain, t_plain = _timed(lambda: hc.generate(model, ids, max_new_tokens=new, cache_config=cache_config))
    for k in s["num_draft_tokens"]:
        spec, t_spec = _timed(
            lambda k=k: hc.generate(
                model,
                ids,
                max_new_tokens=new,
                cache_config=cache_config,
                draft_model=draft,
                draft_cache_config=cache_config,
                num_draft_tokens=int(k),
            )
        )
        st = spec.stats
        rows.append(
            {
                "draft": f"first {layers}/{len(model.decoder_layers)} layers",
                "k": int(k),
                "acceptance_rate": st["acceptance_rate"],
                "tokens_per_target_call": st["tokens_per_target_call"],
                "plain_s": t_plain,
                "speculative_s": t_spec,
                "speedup": t_plain / t_spec,
                "identical": bool(torch.equal(spec.sequences, plain.sequences)),
                "rollback": f"{st['rollback']['target']}/{st['rollback']['draft']}",
            }
        )
    return rows


def prefix_rows(model, cache_config, s: dict[str, Any]) -> list[dict[str, Any]]:
    vocab, n = model.vocab_size, int(s["requests"])
    system = _ids(int(s["system_tokens"]), 2, vocab)
    firsts = [torch.cat([system, _ids(int(s["suffix_tokens"]), 10 + i, vocab)], 1) for i in range(n)]
    new = int(s["turn_new_tokens"])

    def workload(store):
        outs = []
        for ids in firsts:  # first turns: a shared system prompt
            outs.append(hc.generate(model, ids, max_new_tokens=new, cache_config=cache_config, prefix_cache=store))
        for i, out in enumerate(list(outs)):  # second turns: the conversation so far + a new user message
            ids = torch.cat([out.sequences, _ids(int(s["suffix_tokens"]), 100 + i, vocab)], 1)
            outs.append(hc.generate(model, ids, max_new_tokens=new, cache_config=cache_config, prefix_cache=store))
        return outs

    base, t_base = _timed(lambda: workload(None))
    rows = []
    for policy in ("marconi", "all"):
        store = PrefixStore(block_size=int(s["block_size"]), max_bytes=int(s["max_bytes"]), policy=policy)
        outs, t = _timed(lambda store=store: workload(store))
        st = store.stats()
        rows.append(
            {
                "policy": policy,
                "requests": st["requests"],
                "hit_rate": st["hit_rate"],
                "tokens_saved": st["tokens_saved"],
                "saved_fraction": st["saved_fraction"],
                "bytes_held": st["bytes_held"],
                "entries": st["entries"],
                "evicted": st["evicted"],
                "no_reuse_s": t_base,
                "reuse_s": t,
                "speedup": t_base / t,
                "identical": all(torch.equal(a.sequences, b.sequences) for a, b in zip(outs, base)),
            }
        )
    return rows


def run_cache_ops(model, cache_config, settings: dict[str, Any] | None = None, smoke: bool = False) -> dict[str, Any]:
    """Speculative decoding and prefix reuse rows plus flat summary keys (for W&B and benchmark.json)."""
    s = {**DEFAULTS, **dict(settings or {}), **(SMOKE if smoke else {})}
    spec, prefix = speculative_rows(model, cache_config, s), prefix_rows(model, cache_config, s)
    summary: dict[str, Any] = {}
    for r in spec:
        for key in ("acceptance_rate", "tokens_per_target_call", "speedup"):
            summary[f"speculative/{key}/k{r['k']}"] = r[key]
        summary[f"speculative/identical/k{r['k']}"] = r["identical"]
    for r in prefix:
        for key in ("hit_rate", "tokens_saved", "bytes_held", "speedup", "identical"):
            summary[f"prefix_reuse/{key}/{r['policy']}"] = r[key]
    return {"speculative": spec, "prefix_reuse": prefix, "summary": summary}


def print_cache_ops(console: Console, ops: dict[str, Any]) -> None:
    t = Table(title="speculative decoding (greedy, batch 1) vs plain greedy")
    for col in ("draft", "k", "acceptance", "tokens/target call", "speed-up", "identical", "rollback"):
        t.add_column(col, justify="right")
    for r in ops["speculative"]:
        t.add_row(
            r["draft"],
            str(r["k"]),
            f"{r['acceptance_rate']:.2f}",
            f"{r['tokens_per_target_call']:.2f}",
            f"{r['speedup']:.2f}x",
            str(r["identical"]),
            r["rollback"],
        )
    console.print(t)
    p = Table(title="prefix reuse (shared system prompt, then second turns) vs no reuse")
    for col in ("policy", "requests", "hit rate", "tokens saved", "bytes held", "evicted", "speed-up", "identical"):
        p.add_column(col, justify="right")
    for r in ops["prefix_reuse"]:
        p.add_row(
            r["policy"],
            str(r["requests"]),
            f"{r['hit_rate']:.2f}",
            f"{r['tokens_saved']}",
            format_bytes(r["bytes_held"]),
            str(r["evicted"]),
            f"{r['speedup']:.2f}x",
            str(r["identical"]),
        )
    console.print(p)
