"""The study's samples (RULER, MQAR) and its per-strategy summaries: one row per strategy from the measurements of
experiments/study/evaluate.py (perplexity, KL, agreement, passkey, MQAR and RULER), and the bytes its cache holds."""

from __future__ import annotations

import math
import random
from typing import Any

from omegaconf import DictConfig

from experiments.core import mqar
from experiments.long_context.ruler import has_depth, ruler_sample
from experiments.study.evaluate import Continuation, Strategy, agreement, prefix_max, prefix_mean
from experiments.study.report import finite
from experiments.whole_model.byte_counts import kind_bytes, saving


def ruler_samples(r: DictConfig, tokenizer, vocab_size: int) -> tuple[list, list[str]]:
    """Every RULER prompt of the run: task x length x depth (needle tasks only) x trial, seeded; and the (task,
    length) cells that cannot be built with this tokenizer (the template alone is longer), each with why."""
    out, skipped = [], []
    for task in r.tasks:
        for L in r.lengths:
            try:
                out += [
                    ruler_sample(tokenizer, task, int(L), float(d) if d is not None else None, seed=f"{r.seed}-{t}")
                    for d in (r.depths if has_depth(task) else [None])
                    for t in range(int(r.trials))
                ]
            except ValueError as err:
                skipped.append(f"{task} at {L} tokens: {err}")
    if out and max(max(s.ids) for s in out) >= vocab_size:
        raise ValueError(f"the tokenizer produces ids >= the model's vocab_size {vocab_size}")
    return out, skipped


def mqar_samples(m: DictConfig, tokenizer, vocab_size: int) -> list[mqar.Prompt]:
    """Every MQAR example of the run: pairs x trial, seeded (the same examples for every strategy)."""
    rng = random.Random(int(m.seed))
    out = [
        mqar.prompt(tokenizer, rng, int(n), min(int(m.queries), int(n))) for n in m.pairs for _ in range(int(m.trials))
    ]
    if out and max(max(p.ids) for p in out) >= vocab_size:
        raise ValueError(f"the tokenizer produces ids >= the model's vocab_size {vocab_size}")
    return out


def mqar_summary(runs: list[dict], native_runs: list[dict]) -> dict[str, Any]:
    """MQAR recall: the share of queries recalled, per pair count and per distance (tokens back to the pair: [0, 64),
    [64, 128), ... doubling), each query marked with whether native recalled it."""
    if not runs:
        return {"mqar_acc": None}
    for t, nt in zip(runs, native_runs):
        for q, nq in zip(t["queries"], nt["queries"]):
            q["native_correct"] = nq["correct"]
    by_pairs: dict[str, list[int]] = {}
    by_distance: dict[str, list[int]] = {}
    for t in runs:
        cell = by_pairs.setdefault(str(t["pairs"]), [0, 0])
        for q in t["queries"]:
            cell[0] += q["correct"]
            cell[1] += 1
            low = 64
            while q["distance"] >= 2 * low:
                low *= 2
            d = by_distance.setdefault("0-63" if q["distance"] < 64 else f"{low}-{2 * low - 1}", [0, 0])
            d[0] += q["correct"]
            d[1] += 1
    queries = [q for t in runs for q in t["queries"]]
    return {
        "mqar_acc": sum(q["correct"] for q in queries) / len(queries),
        "mqar_by_pairs": by_pairs,
        "mqar_by_distance": dict(sorted(by_distance.items(), key=lambda kv: int(kv[0].split("-")[0]))),
        "mqar_trials": runs,
    }


def ruler_summary(runs: list[dict]) -> dict[str, Any]:
    """Mean RULER score (0-100) per task and prompt length, and over everything."""
    cells: dict[str, dict[str, list[float]]] = {}
    for t in runs:
        cells.setdefault(t["task"], {}).setdefault(str(t["length"]), []).append(t["score"])
    return {
        "ruler": {task: {L: sum(v) / len(v) for L, v in by.items()} for task, by in cells.items()},
        "ruler_mean": sum(t["score"] for t in runs) / len(runs) if runs else None,
        "ruler_trials": runs,
    }


def summarize(
    name,
    config,
    plan,
    native_plan,
    docs: list[Strategy],
    native_docs: list[Strategy],
    cont: list[Continuation],
    native_cont: list[Continuation],
    trials,
    native_trials,
    lengths: list[int],
    native_bytes: int,
) -> dict[str, Any]:
    """One strategy's row: per context length, means over documents (no blockwise numbers for a strategy that
    compresses after the prefill: `docs` is empty)."""
    ppl, kl, kl_max, top1, greedy, diverges = {}, {}, {}, {}, {}, {}
    c_ppl, c_kl, c_top1 = {}, {}, {}
    for L in lengths:
        n = L - 1
        if docs:
            ppl[str(L)] = math.exp(sum(prefix_mean(d.nll, n) for d in docs) / len(docs))
            kl[str(L)] = sum(prefix_mean(d.kl, n) for d in docs) / len(docs)
            kl_max[str(L)] = max(prefix_max(d.kl, n) for d in docs)
            top1[str(L)] = sum(prefix_mean([t.float() for t in d.top1], n) for d in docs) / len(docs)
        if cont:
            c_ppl[str(L)] = math.exp(sum(float(c.nll[L].double().mean()) for c in cont) / len(cont))
            c_kl[str(L)] = sum(float(c.kl[L].double().mean()) for c in cont) / len(cont)
            c_top1[str(L)] = sum(float(c.top1[L].double().mean()) for c in cont) / len(cont)
        ours, theirs = (
            ([d.greedy.get(L) for d in docs], [d.greedy.get(L) for d in native_docs])
            if docs
            else ([c.greedy.get(L) for c in cont], [c.greedy.get(L) for c in native_cont])
        )
        if ours and ours[0]:
            pairs = [agreement(a, b) for a, b in zip(ours, theirs)]
            greedy[str(L)] = sum(a for a, _ in pairs) / len(pairs)
            steps = [s for _, s in pairs if s is not None]
            diverges[str(L)] = min(steps) if steps else None
    for t, nt in zip(trials, native_trials):
        t["native_correct"] = nt["correct"]
    correct = sum(t["correct"] for t in trials)
    by_length: dict[str, list[int]] = {}
    for t in trials:  # per requested prompt length: [correct, trials]
        cell = by_length.setdefault(str(t["requested"]), [0, 0])
        cell[0] += int(t["correct"])
        cell[1] += 1
    peak = peak_bytes(plan, max(lengths))
    after = docs[0].nbytes_after if docs else cont[0].nbytes_after_prompt[max(lengths)] if cont else None
    after_split = (
        docs[0].nbytes_after_split if docs else cont[0].nbytes_after_prompt_split[max(lengths)] if cont else {}
    )
    return {
        "name": name,
        "config": config,
        "exact_cache": plan.exact,
        "changed_layers": plan.changed(native_plan),
        "bytes": peak,
        "bytes_ratio": peak / native_bytes if native_bytes else float("nan"),
        **whole_cache_columns(plan, native_plan, max(lengths)),
        "bytes_after": after,
        "bytes_after_kv": after_split.get("kv"),
        "bytes_after_state": after_split.get("state"),
        "planned_bytes": {str(L): plan.held_nbytes(1, L) for L in lengths},
        "peak_bytes": {str(L): peak_bytes(plan, L) for L in lengths},
        "ppl": ppl,
        "kl": kl,
        "kl_max": {k: finite(v) for k, v in kl_max.items()},
        "top1": top1,
        "continuation_ppl": c_ppl,
        "continuation_kl": c_kl,
        "continuation_top1": c_top1,
        "greedy_agreement": greedy,
        "greedy_diverges_at": diverges,
        "greedy_tokens": {str(L): (docs[0].greedy if docs else cont[0].greedy).get(L) for L in lengths}
        if docs or cont
        else {},
        "passkey": trials,
        "passkey_correct": correct,
        "passkey_trials": len(trials),
        "passkey_by_length": by_length,
        "passkey_acc": correct / len(trials) if trials else None,
    }


def peak_bytes(plan, tokens: int) -> int:
    """The most bytes the cache holds between blocks at batch 1 over a sequence of `tokens` tokens (from the specs;
    a chunked cache is empty right after a chunk boundary, so its bytes after the run say little)."""
    return max(plan.held_nbytes(1, t) for t in range(1, tokens + 1))


def peak_by_part(plan, tokens: int) -> dict[str, int]:
    """`peak_bytes`'s bytes split into keys/values and recurrent states ({"kv", "state"}), at the token count where
    the whole cache peaks (the last such count)."""
    at = max(range(1, tokens + 1), key=lambda t: (plan.held_nbytes(1, t), t))
    return kind_bytes(plan.layers, lambda p: p.spec.held_nbytes(1, at))


def whole_cache_columns(plan, native_plan, tokens: int) -> dict[str, Any]:
    """The row's bytes split into KV and recurrent state, native's beside them, and the saving on the WHOLE cache
    (what a user pays for) next to the saving on each part (what the strategy touches); a part native does not hold
    has no saving (None)."""
    ours, native = peak_by_part(plan, tokens), peak_by_part(native_plan, tokens)
    return {
        "kv_bytes": ours["kv"],
        "state_bytes": ours["state"],
        "native_kv_bytes": native["kv"],
        "native_state_bytes": native["state"],
        "saving": saving(ours["kv"] + ours["state"], native["kv"] + native["state"]),
        "kv_saving": saving(ours["kv"], native["kv"]),
        "state_saving": saving(ours["state"], native["state"]),
    }
