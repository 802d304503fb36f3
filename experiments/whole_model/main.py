"""Whole-model cache savings on production hybrids: how much of the cache is keys/values, and what a 4x KV
compression or int8 / fp8 / bf16 recurrent states save on the WHOLE cache (not only on the part they touch).

Each production config (configs/production/*.json, published shapes, no weights) is built by our family code on the
meta device; each strategy is a cache config resolved through our cache plan, and bytes come from our own
accounting (experiments/whole_model/byte_counts.py), at batch 1 after a prompt of each length fed in one block:

    python -m experiments.whole_model.main                       # writes docs/whole_model_savings.md and its figure
    python -m experiments.whole_model.main --models nemotron_h_8b --tokens 8192 --out /tmp/wm.md

Bytes only: what each strategy costs in quality is the study's business (experiment=study), per model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from experiments.whole_model import configs as production
from experiments.whole_model.byte_counts import CONV, KV_PREFIX, SSM, kv_bytes, part_bytes, saving, state_bytes
from experiments.whole_model.labels import gib, pct, short_name, tokens_label
from hybridcache.cache.core.plan import resolve_plan

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "whole_model_savings.md"
FIGURE = ROOT / "docs" / "figures" / "whole_model_savings.png"
TOKENS = (32768, 131072)
#: The issue's order (Qwen3.5, Qwen3-Next, Jamba, Nemotron-H, Granite 4.0, Falcon-H1); other configs follow.
ORDER = (
    "qwen3_5_27b",
    "qwen3_5_35b_a3b",
    "qwen3_next_80b_a3b",
    "jamba_v0_1",
    "nemotron_h_8b",
    "nemotron_h_47b",
    "granite_4_0_h_small",
    "falcon_h1_7b",
    "falcon_h1_34b",
)

KV_DIV4 = {"type": "snapkv", "compression_ratio": 0.75}  # a prefill press keeping 1/4 of the prompt's tokens
#: name -> (label, cache config). native first: every saving is read against it.
STRATEGIES: dict[str, tuple[str, dict[str, Any] | None]] = {
    "native": ("native", None),
    "kv_div4": ("KV ÷4", {"attention": KV_DIV4}),
    "state_bf16": ("states bf16", {"recurrent": {"state_codec": "bfloat16"}}),
    "state_fp8": ("states fp8", {"recurrent": {"state_codec": "float8_e4m3fn"}}),
    "state_int8": ("states int8", {"recurrent": {"state_codec": "int8"}}),
    "kv_div4+state_int8": ("KV ÷4 + int8 states", {"attention": KV_DIV4, "recurrent": {"state_codec": "int8"}}),
}


class WholeModelError(production.ProductionConfigError):
    """Bad arguments to the whole-model table (token counts)."""


def check_tokens(tokens: Sequence[Any]) -> list[int]:
    if not tokens or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tokens):
        raise WholeModelError(f"tokens must be positive integers, got {list(tokens)!r}")
    return sorted(set(tokens))


def model_rows(p: production.Production, tokens: Sequence[int]) -> list[dict[str, Any]]:
    """One row per prompt length: bytes by part under every strategy, the KV share, every whole-cache saving."""
    plans = {name: resolve_plan(p.native, config) for name, (_, config) in STRATEGIES.items()}
    rows = []
    for t in tokens:
        parts = {name: part_bytes(plan, 1, t) for name, plan in plans.items()}
        totals = {name: sum(v.values()) for name, v in parts.items()}
        native = parts["native"]
        rows.append(
            {
                "model": p.name,
                "model_id": p.model_id,
                "label": short_name(p.model_id),
                "tokens": t,
                "parts": parts,
                "totals": totals,
                "kv_share": kv_bytes(native) / totals["native"],
                "savings": {name: saving(total, totals["native"]) for name, total in totals.items()},
                "kv_saving": {name: saving(kv_bytes(v), kv_bytes(native)) for name, v in parts.items()},
                "state_saving": {name: saving(state_bytes(v), state_bytes(native)) for name, v in parts.items()},
            }
        )
    return rows


def compute(names: Sequence[str], tokens: Sequence[int], console: Any = None) -> dict[str, Any]:
    tokens = check_tokens(list(tokens))
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    models, rows = [], []
    with Progress(*columns, console=console, transient=True, disable=console is None) as progress:
        task = progress.add_task("building production configs on the meta device", total=len(names))
        for name in names:
            progress.update(task, description=f"building {name} on the meta device")
            p = production.build(name)
            models.append(
                {
                    "name": p.name,
                    "model_id": p.model_id,
                    "model_type": p.model_type,
                    "family": p.family,
                    "dtype": str(p.dtype).removeprefix("torch."),
                    "layers": layer_counts(p.native),
                    "sources": list(p.config.get("_sources") or []),
                    "unconfirmed": list(p.unconfirmed),
                }
            )
            rows += model_rows(p, tokens)
            progress.advance(task)
    return {"tokens": tokens, "strategies": {k: v[1] for k, v in STRATEGIES.items()}, "models": models, "rows": rows}


def layer_counts(native: Sequence[Any]) -> dict[str, int]:
    """Cache layers per native type (a group counts each member)."""
    counts: dict[str, int] = {}
    for p in resolve_plan(native).layers:
        counts[p.native_type] = counts.get(p.native_type, 0) + 1
    return counts


# -- the markdown ---------------------------------------------------------------------------------------------------
PATTERNS = ("full", "sliding", "chunked")


def kv_types(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The native attention types present in the rows."""
    return sorted({k.removeprefix(KV_PREFIX) for r in rows for k in r["parts"]["native"] if k.startswith(KV_PREFIX)})


def holds_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    types = [*PATTERNS, *(t for t in kv_types(rows) if t not in PATTERNS)]  # each pattern shown, held or not
    head = ["model", "tokens", *[f"KV {t}" for t in types], "conv states", "SSM / delta states", "whole cache"]
    head.append("KV share")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        n = r["parts"]["native"]
        cells = [r["label"], tokens_label(r["tokens"])]
        cells += [gib(n[KV_PREFIX + t]) if n.get(KV_PREFIX + t) else "-" for t in types]
        cells += [gib(n[CONV]), gib(n[SSM]), gib(r["totals"]["native"]), pct(r["kv_share"])]
        out.append("| " + " | ".join(cells) + " |")
    return out


def savings_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    names = [n for n in STRATEGIES if n != "native"]
    head = ["model", "tokens", "whole cache", *[f"{STRATEGIES[n][0]}" for n in names]]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"], tokens_label(r["tokens"]), gib(r["totals"]["native"])]
        cells += [f"{pct(r['savings'][n])} ({gib(r['totals'][n])})" for n in names]
        out.append("| " + " | ".join(cells) + " |")
    return out


def sources_table(models: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [
        "| model | config file | built by our family | cache layers | where the numbers come from | not confirmed |",
        "|---|---|---|---|---|---|",
    ]
    for m in models:
        built = m["family"] + ("" if m["family"] == m["model_type"] else f" (published type {m['model_type']})")
        layers = ", ".join(f"{n} {t}" for t, n in m["layers"].items())
        out.append(
            f"| {m['model_id']} | `configs/production/{m['name']}.json` | {built} | {layers} | "
            + "<br>".join(m["sources"])
            + " | "
            + ("<br>".join(m["unconfirmed"]) or "-")
            + " |"
        )
    return out


def extremes(rows: Sequence[Mapping[str, Any]], t: int, key: Any) -> tuple[Mapping, Mapping]:
    at = [r for r in rows if r["tokens"] == t]
    return min(at, key=key), max(at, key=key)


def reading(result: Mapping[str, Any]) -> list[str]:
    """Sentences read off the numbers (computed, so they stay true when the configs change)."""
    rows, out = result["rows"], []
    for t in result["tokens"]:
        lo, hi = extremes(rows, t, lambda r: r["kv_share"])
        s_lo, s_hi = extremes(rows, t, lambda r: r["savings"]["state_int8"])
        k_lo, k_hi = extremes(rows, t, lambda r: r["savings"]["kv_div4"])
        out.append(
            f"- At {tokens_label(t)} tokens keys and values are {pct(lo['kv_share'])} ({lo['label']}) to "
            f"{pct(hi['kv_share'])} ({hi['label']}) of the whole cache. A 4x KV compression saves "
            f"{pct(k_lo['savings']['kv_div4'])} ({k_lo['label']}) to {pct(k_hi['savings']['kv_div4'])} "
            f"({k_hi['label']}) of it; int8 recurrent states save {pct(s_lo['savings']['state_int8'])} "
            f"({s_lo['label']}) to {pct(s_hi['savings']['state_int8'])} ({s_hi['label']})."
        )
    return out


def markdown(result: Mapping[str, Any], figure: str, command: str) -> str:
    rows, models = result["rows"], result["models"]
    lines = [
        "# Whole-model cache savings on production hybrids",
        "",
        "<!-- generated by `" + command + "`; edit experiments/whole_model/main.py, not this file -->",
        "",
        "How much of a production hybrid's cache is keys and values, and what a saving on one part is worth on the",
        "whole cache. Each model's published shapes (`configs/production/`, no weights; sources below) are built by",
        "our own family code on the meta device; every strategy is a cache config resolved by our cache plan, and",
        "every byte comes from our Cache's own accounting (the specs' bytes, as the budget planner reads them), at",
        "batch 1 after a prompt of that many tokens. Keys, values and conv states are in the model's dtype",
        "(bfloat16); SSM and delta-rule states in float32, our Cache's default (the copies of Qwen3.5's configs we",
        "found set `mamba_ssm_dtype: float32`, and transformers' NemotronHConfig defaults `mamba_ssm_cache_dtype` to",
        "float32; an engine that keeps states in bfloat16 holds what the `states bf16` column shows). Bytes only:",
        "what each strategy costs in quality is measured per model by `experiment=study`.",
        "",
        "## What the cache holds",
        "",
        *holds_table(rows),
        "",
        "## What each saving is worth on the whole cache",
        "",
        "The share of the whole native cache saved (the cache's bytes under that strategy in parentheses):",
        "",
        *savings_table(rows),
        "",
        f"![KV and recurrent state bytes per model, with the savings]({figure})",
        "",
        *reading(result),
        "",
        "What the strategies are, as cache configs:",
        "",
        "- **KV ÷4**: every attention layer a prefill press keeping a quarter of the prompt's tokens "
        "(`snapkv`, `compression_ratio: 0.75`; any press at that ratio holds the same bytes): exactly 4x fewer "
        "key/value bytes after the prompt.",
        "- **states bf16 / fp8 / int8**: every recurrent layer's SSM or delta-rule state held as bfloat16, "
        "float8_e4m3fn or int8 (`state_codec`), fp8 and int8 with one float32 scale per vector along the state's "
        "last axis (included in the bytes); conv states stay in bfloat16 (`quantize_conv` off, the default).",
        "- **KV ÷4 + int8 states**: both at once (fp8 states hold the same bytes as int8).",
        "",
        "## Where the numbers come from",
        "",
        "No network here but package registries: the configs were written from public copies of the models'",
        "`config.json` and from code that lists their shapes (found through a code and documentation search). A number",
        "no source confirmed is listed as such; numbers that do not set the cache's shapes (vocabulary, MLP sizes)",
        "only let our loader build the model.",
        "",
        *sources_table(models),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from experiments.core.common import make_console
    from experiments.core.results import write_output
    from experiments.whole_model.plot import plot

    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--models", nargs="+", default=None, help="production configs (default: every one)")
    a.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    a.add_argument("--out", default=str(DOC), help="the markdown page")
    a.add_argument("--figure", default=None, help="the figure (default: figures/whole_model_savings.png beside --out)")
    a.add_argument("--json", default=None, help="also write the numbers as JSON")
    args = a.parse_args(argv)
    console = make_console()
    known = production.available()
    names = args.models or [n for n in ORDER if n in known] + [n for n in known if n not in ORDER]
    result = compute(names, args.tokens, console)
    out = Path(args.out)
    figure = Path(args.figure) if args.figure else out.parent / "figures" / "whole_model_savings.png"
    for directory in {out.parent, figure.parent}:
        directory.mkdir(parents=True, exist_ok=True)
    plot(result, figure, STRATEGIES)
    given = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m experiments.whole_model.main", *given])
    here = out.parent.resolve()
    link = figure.resolve().relative_to(here) if figure.resolve().is_relative_to(here) else figure.resolve()
    write_output(out, markdown(result, link.as_posix(), command))
    if args.json:
        write_output(args.json, json.dumps(result, indent=1))
    console.print("\n".join(holds_table(result["rows"]) + [""] + savings_table(result["rows"])), highlight=False)
    console.print(f"wrote {out} and {figure}" + (f" and {args.json}" if args.json else ""))
    return result


if __name__ == "__main__":
    main()
