"""Presentation of caches and plans as rich tables (kept out of `hybridcache.cache`, which is pure torch)."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from hybridcache.cache import Cache, CachePlan
from hybridcache.cache.core.plan import fmt_value, format_bytes


def plan_table(plan: CachePlan, batch: int = 1, tokens: int = 4096, native: CachePlan | None = None) -> Table:
    """Decoder layer, member, native type, cache type, parameters, exactness and bytes of every cache layer.

    With `native`, a last column marks the layers the plan changes."""
    t = Table(title=f"cache plan (bytes for batch {batch} after {tokens} tokens)")
    cols = ["layer", "member", "native", "cache type", "parameters", "exact", "bytes"] + (["changed"] if native else [])
    for col in cols:
        t.add_column(col, justify="right" if col in ("layer", "bytes") else "left")
    changed = set(plan.changed(native)) if native else set()
    for p in plan.layers:
        params = ", ".join(
            f"{k}={fmt_value(v)}"
            for k, v in p.spec.params().items()
            if v is not None and not (k == "storage" and v == "dense")
        )
        row = [
            str(p.index),
            p.member or "",
            p.native_type,
            p.type,
            params,
            "yes" if p.exact else "lossy",
            format_bytes(p.spec.held_nbytes(batch, tokens)),
        ]
        t.add_row(*row, *(["*" if p.address in changed else ""] if native else []))
    t.add_row("all", "", "", "", "", "", format_bytes(plan.held_nbytes(batch, tokens)), style="bold")
    return t


def memory_table(cache: Cache) -> Table:
    """Bytes held per cache type vs the theoretical minimum for what the rows have seen."""
    t = Table(title=f"cache memory (batch {cache.batch_size}, {cache.columns} columns)")
    for col in ("type", "layers", "held", "minimum", "held / minimum"):
        t.add_column(col, justify="left" if col == "type" else "right")
    for r in cache.memory_report():
        t.add_row(r["type"], str(r["layers"]), format_bytes(r["held"]), format_bytes(r["minimum"]), f"{r['ratio']:.2f}")
    return t


def render(table: Table, width: int | None = None) -> str:
    """A rich table as plain text (for logs, README examples and tests); natural width unless given."""
    out = io.StringIO()
    Console(file=out, width=width or 200, soft_wrap=True).print(table)
    return out.getvalue()


def render_plan(plan: CachePlan, batch: int = 1, tokens: int = 4096, native: CachePlan | None = None) -> str:
    return render(plan_table(plan, batch, tokens, native))


def render_memory(cache: Cache) -> str:
    return render(memory_table(cache))
