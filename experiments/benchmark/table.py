"""The benchmark's numbers as rows, summary keys and tables: rates and ratios only from reliable timings
(experiments/benchmark/timing.py); an unreliable one is shown as "unreliable" with its reason, never as a number."""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console
from rich.table import Table

from experiments.benchmark.timing import Timing, rate, ratio
from hybridcache.cache.core.plan import format_bytes


def row_key(system: str) -> str:
    """A summary-key form of a row's system: 'ours (eager, int8 weights)' -> 'ours_eager_int8_weights'."""
    return re.sub(r"[^a-z0-9]+", "_", system.lower()).strip("_")


def timed_row(system: str, batch: int, prompt: int, new: int, prefill: Timing, decode: Timing) -> dict[str, Any]:
    """One throughput row: tokens/s (None when unreliable), the medians, spreads, repeats and reasons."""
    return {
        "system": system,
        "batch": batch,
        "prefill_tok_s": rate(batch * prompt, prefill),
        "decode_tok_s": rate(batch * (new - 1), decode),  # the decode steps produce the other new - 1 tokens
        "prefill_s": prefill.median_s,
        "decode_s": decode.median_s,
        "prefill_spread": prefill.spread,
        "decode_spread": decode.spread,
        "repeats": len(decode.samples),
        "prefill_unreliable": prefill.reason,
        "decode_unreliable": decode.reason,
    }


def summarize(rows, memory, scaling, rss_mib, seconds) -> dict[str, Any]:
    """Summary keys; a speed-up vs HF only where both timings are reliable (the reason is kept otherwise)."""
    out: dict[str, Any] = {"peak_rss_mib": rss_mib, "throughput_wall_s": seconds}
    hf = {r["batch"]: r for r in rows if r["system"] == "hf"}
    # llama.cpp at the precision of one of our weight formats: (batch, format) -> its row
    llama = {(r["batch"], r.get("weights_format")): r for r in rows if r["system"].startswith("llama.cpp")}
    for r in rows:
        key, b = row_key(r["system"]), r["batch"]
        out[f"decode_tok_s/{key}/b{b}"] = r["decode_tok_s"]
        if r.get("engine_start_s") is not None:
            out[f"engine_start_s/{key}/b{b}"] = r["engine_start_s"]  # excluded from its tokens/s
        if r["system"].startswith("ours") and b in hf:
            for phase in ("decode", "prefill"):
                value, why = ratio(
                    r[f"{phase}_tok_s"],
                    r.get(f"{phase}_unreliable"),
                    hf[b][f"{phase}_tok_s"],
                    hf[b].get(f"{phase}_unreliable"),
                )
                out[f"{phase}_speedup_vs_hf/{key}/b{b}"] = value
                if why:
                    out[f"{phase}_speedup_vs_hf_unreliable/{key}/b{b}"] = why
        partner = llama.get((b, r.get("weights_format")))
        if r["system"].startswith("ours") and partner is not None:
            for phase in ("decode", "prefill"):
                value, why = ratio(
                    r[f"{phase}_tok_s"],
                    r.get(f"{phase}_unreliable"),
                    partner[f"{phase}_tok_s"],
                    partner.get(f"{phase}_unreliable"),
                    name=partner["system"],
                )
                out[f"{phase}_speedup_vs_llamacpp/{key}/b{b}"] = value
                if why:
                    out[f"{phase}_speedup_vs_llamacpp_unreliable/{key}/b{b}"] = why
        if r.get("roofline_fraction") is not None:
            out[f"roofline_fraction/{key}/b{b}"] = r["roofline_fraction"]
    for batch, report in memory.items():
        for m in report:
            out[f"cache_held_over_min/{m['type']}/b{batch}"] = m["ratio"]
    for strategy in {r["strategy"] for r in scaling}:
        points = sorted((r["tokens"], r["peak_rss_mib"]) for r in scaling if r["strategy"] == strategy)
        out[f"rss_ratio_longest_vs_shortest/{strategy}"] = points[-1][1] / points[0][1]
    return out


def _rate_cell(r: dict, phase: str, digits: int) -> str:
    value = r.get(f"{phase}_tok_s")
    if value is None:
        return "unreliable"
    spread = r.get(f"{phase}_spread")
    return f"{value:.{digits}f}" + (f" ±{spread / 2:.0%}" if spread is not None else "")


def throughput_table(rows: list[dict], summary: dict) -> tuple[Table, list[str]]:
    """The throughput table and the notes saying why a figure is shown as unreliable."""
    t = Table(title="throughput (tokens/s, medians ± half the interquartile spread; prefill and decode timed apart)")
    # ours / llama.cpp at the same precision, beside ours / HF, when reference=llamacpp ran
    refs = ("hf", "llamacpp") if any(k.startswith("decode_speedup_vs_llamacpp/") for k in summary) else ("hf",)
    names = {"hf": "HF", "llamacpp": "llama.cpp"}
    cols = ["system", "batch"]
    for phase in ("prefill", "decode"):
        cols += [f"{phase} tok/s", *(f"{phase} vs {names[ref]}" for ref in refs)]
    for col in (*cols, "roofline tok/s"):
        t.add_column(col, justify="left" if col == "system" else "right")
    t.add_column("of roofline", justify="right")
    notes: list[str] = []
    for r in rows:
        key, b = row_key(r["system"]), r["batch"]
        cells = []
        for phase, digits in (("prefill", 0), ("decode", 1)):
            cells.append(_rate_cell(r, phase, digits))
            if r.get(f"{phase}_unreliable"):
                notes.append(f"{r['system']}, batch {b}, {phase}: unreliable: {r[f'{phase}_unreliable']}")
            for ref in refs:
                speed = summary.get(f"{phase}_speedup_vs_{ref}/{key}/b{b}")
                present = f"{phase}_speedup_vs_{ref}/{key}/b{b}" in summary
                cells.append(f"{speed:.2f}x" if speed else ("unreliable" if present else ""))
        limit = r.get("roofline_tok_s")
        frac = r.get("roofline_fraction")
        label = r["system"] + (f" (engine start {r['engine_start_s']:.0f} s, apart)" if r.get("engine_start_s") else "")
        t.add_row(
            label,
            str(b),
            *cells,
            f"{limit:.1f}" if limit else "",
            f"{frac:.0%}" if frac is not None else ("unreliable" if limit else ""),
        )
    return t, notes


def print_tables(console: Console, rows, memory, scaling, summary) -> None:
    t, notes = throughput_table(rows, summary)
    console.print(t)
    for note in notes:
        console.print(f"[yellow]{note}[/] (no rate or ratio is given from it)", soft_wrap=True)
    roof = summary.get("roofline")
    if roof:
        lo, hi = roof["read_bandwidth_range_gb_s"]
        console.print(
            f"roofline: read bandwidth {roof['read_bandwidth_gb_s']:.1f} GB/s (a streaming read-only sum "
            f"over {roof['probe_mib']} MiB: the median of {roof['probe_passes']} passes taken between the timing "
            f"rounds, ranging {lo:.1f}-{hi:.1f} GB/s; each batch size's rows use its own rounds' median); a "
            "decode step reads "
            f"{format_bytes(roof['weights'])} "
            f"of {roof['dtype']} weights (tied head included, untied input embeddings excluded; packed "
            "formats: their own bytes) + the cache; roofline tok/s = batch x bandwidth / (weights + cache "
            f"bytes). CPU decode kernels: {roof['cpu_kernels']}",
            soft_wrap=True,
        )
    m = Table(title="cache memory after the throughput run (held vs theoretical minimum)")
    for col in ("batch", "type", "held", "minimum", "ratio"):
        m.add_column(col, justify="right")
    for batch, report in memory.items():
        for r in report:
            m.add_row(str(batch), r["type"], format_bytes(r["held"]), format_bytes(r["minimum"]), f"{r['ratio']:.2f}")
    console.print(m)
    s = Table(title="long context (prefill in chunks, then decode)")
    for col in ("strategy", "prompt tokens", "prefill s", "decode ms/token", "peak RSS MiB", "cache held"):
        s.add_column(col, justify="left" if col == "strategy" else "right")
    for r in scaling:
        s.add_row(
            r["strategy"],
            str(r["tokens"]),
            f"{r['prefill_s']:.2f}",
            f"{r['decode_ms_per_token']:.2f}",
            f"{r['peak_rss_mib']:.0f}",
            format_bytes(r["cache_bytes"]),
        )
    if scaling:
        console.print(s)
