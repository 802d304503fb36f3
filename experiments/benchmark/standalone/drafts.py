"""Speculative decoding on real text: which drafts pay, measured against plain decoding of the same requests.

    python -m experiments.benchmark.standalone.drafts --model gemma3_270m [--new 64] [--rounds 3] [--out drafts.json]
    python -m experiments.benchmark.standalone.drafts --model trained_hybrid

Texts (standard library, so nothing downloads): `prose`, a passage of the Python language reference
(pydoc_data.topics), continued; `copy`, a stdlib source file followed by its own first lines again, continued (the
edit / extraction pattern where output repeats input). Drafts: prompt lookup (PromptLookupDraft, no model), an
early exit of the target's first half (EarlyExitDraft), a separate draft model that is the target with packed
weights (`bfloat16`, `int8`, `q8_0`: fewer bytes a step, the same vocabulary, close logits), greedy and sampled
(temperature 0.7, top-k 20: speculative sampling, an exact sample, so not the same tokens as plain sampling). Plain
and speculative runs alternate (`rounds` each, medians), batch 1; `decode_speedup` leaves the prefill out (each
side's one-token generation subtracted: a separate draft model prefills the prompt too). Greedy outputs must be
identical to plain greedy; the table says so.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import hybridcache as hc

MODELS = {"gemma3_270m": "real", "trained_hybrid": "hybridcache/trained/bamba_bytes"}


PACKED = ("bfloat16", "int8", "q8_0")  # draft kinds that are the target with packed weights


def checkpoint_of(name: str) -> Path:
    if MODELS[name] == "real":
        from hybridcache.checkpoints.real import real_checkpoint

        return real_checkpoint(name)
    return Path(__file__).resolve().parents[3] / MODELS[name]


def load(name: str):
    path = checkpoint_of(name)
    if MODELS[name] == "real":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        return hc.from_pretrained(path), lambda text: tok(text, return_tensors="pt").input_ids
    return hc.from_pretrained(path), lambda text: torch.tensor([list(text.encode()[:2048])], dtype=torch.long)


def texts(tokens_of, limit: int) -> dict[str, torch.Tensor]:
    import json as module
    from pydoc_data.topics import topics

    prose = topics["exceptions"] + topics["assert"]
    source = inspect.getsource(module.decoder)
    out = {"prose": tokens_of(prose), "copy": tokens_of(source[:3000] + "\n\n" + source[:400])}
    return {k: v[:, -limit:] for k, v in out.items()}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure(model, ids, new: int, rounds: int, draft, sampled: bool, cache_config=None) -> dict:
    """Plain and speculative generation of `new` tokens alternating (medians), and of one token (the prefill:
    the target's, plus the draft model's own for a separate draft), so the decode phase's speed-up is told apart
    from the end-to-end one."""
    kw = {"output_logits": False, "cache_config": cache_config}
    if sampled:
        kw |= {"do_sample": True, "temperature": 0.7, "top_k": 20, "seed": 0}
    spec_kw = {"draft_model": draft, "num_draft_tokens": 4, "draft_cache_config": cache_config}
    times: dict[str, list[float]] = {"plain": [], "spec": [], "plain1": [], "spec1": []}
    for _ in range(rounds):  # alternating: the host's noise falls on both alike
        plain, t = timed(lambda: hc.generate(model, ids, max_new_tokens=new, **kw))
        times["plain"].append(t)
        spec, t = timed(lambda: hc.generate(model, ids, max_new_tokens=new, **spec_kw, **kw))
        times["spec"].append(t)
        times["plain1"].append(timed(lambda: hc.generate(model, ids, max_new_tokens=1, **kw))[1])
        times["spec1"].append(timed(lambda: hc.generate(model, ids, max_new_tokens=1, **spec_kw, **kw))[1])
    st = spec.stats
    med = {k: statistics.median(v) for k, v in times.items()}
    decode_plain, decode_spec = med["plain"] - med["plain1"], med["spec"] - med["spec1"]
    return {
        "acceptance_rate": round(st["acceptance_rate"], 3),
        "tokens_per_target_call": round(st["tokens_per_target_call"], 2),
        "plain_s": round(med["plain"], 3),
        "speculative_s": round(med["spec"], 3),
        "speedup": round(med["plain"] / med["spec"], 2),
        "decode_speedup": round(decode_plain / decode_spec, 2) if decode_spec > 0 else None,
        "identical": None if sampled else bool(torch.equal(plain.sequences, spec.sequences)),
        "rollback": f"{st['rollback']['target']}/{st['rollback']['draft']}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma3_270m")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=768, help="prompt tokens kept (the end of each text)")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--drafts",
        default="lookup,early_exit,int8",
        help=f"comma-separated: lookup, early_exit, or a packed copy of the target: {', '.join(PACKED)}",
    )
    parser.add_argument("--modes", default="greedy,sampled", help="comma-separated: greedy, sampled")
    parser.add_argument(
        "--full-attention",
        action="store_true",
        help="every attention layer full (exact only while prompt + new tokens fit the sliding window): the "
        "target's rollback becomes a crop instead of snapshot + recompute",
    )
    a = parser.parse_args()
    if unknown := set(a.drafts.split(",")) - {"lookup", "early_exit", *PACKED}:
        parser.error(f"--drafts: unknown {sorted(unknown)}")
    torch.manual_seed(0)
    model, tokens_of = load(a.model)
    half = max(1, len(model.decoder_layers) // 2)
    wanted = a.drafts.split(",")
    drafts = {}
    if "lookup" in wanted:
        drafts["prompt lookup"] = hc.PromptLookupDraft()
    if "early_exit" in wanted:
        drafts[f"early exit {half}/{len(model.decoder_layers)}"] = None
    for fmt in PACKED:
        if fmt in wanted:
            drafts[f"{fmt} copy"] = hc.from_pretrained(checkpoint_of(a.model), weights=fmt)
    cache_config = {"attention": {"type": "full"}} if a.full_attention else None
    modes = [m == "sampled" for m in a.modes.split(",")]
    rows = []
    for text, ids in texts(tokens_of, a.prompt).items():
        hc.generate(model, ids, max_new_tokens=2)  # warm-up
        for name, draft in drafts.items():
            draft = draft or hc.EarlyExitDraft(model, half)
            for sampled in modes:
                row = {"text": text, "draft": name, "mode": "sampled" if sampled else "greedy"}
                rows.append(row | measure(model, ids, a.new, a.rounds, draft, sampled, cache_config))
                print(json.dumps(rows[-1]), flush=True)
    table = Table(title=f"speculative decoding, {a.model}, batch 1, {a.new} new tokens (medians of {a.rounds})")
    for col in rows[0]:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console().print(table)
    if a.out:
        a.out.write_text(json.dumps({"model": a.model, "new_tokens": a.new, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
