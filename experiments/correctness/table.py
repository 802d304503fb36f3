"""The correctness experiment's per-prompt rows and table, with token counts that cannot be misread: how many tokens
each side generated (and whether it stopped early at its end-of-sequence token) apart from how many steps the
agreement and the oracle compared."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def prompt_row(text: str, gen, check, tokenizer, max_new: int, ref=None, comparison=None) -> dict[str, Any]:
    """One prompt: `gen` ours (a Generation), `check` the oracle's, `ref` / `comparison` the reference's, if any."""
    row: dict[str, Any] = {
        "prompt": text,
        "prompt_tokens": len(gen.prompt),
        "ours_text": tokenizer.decode(gen.tokens),
        "max_new_tokens": max_new,
        "new_tokens": len(gen.tokens),  # = generated_ours (the name earlier results.json files use)
        "generated_ours": len(gen.tokens),
        "stopped_early_ours": len(gen.tokens) < max_new,  # its end-of-sequence token came first
        "oracle_compared": len(gen.tokens),  # the oracle checks the logits of every token ours generated
        "oracle_pass": check.passed,
        "oracle_max_dlogit": check.max_abs_dlogit,
        "oracle_tokens_equal": check.tokens_equal,
    }
    if comparison is not None:
        row.update(
            reference_text=tokenizer.decode(ref.tokens),
            generated_reference=len(ref.tokens),
            stopped_early_reference=len(ref.tokens) < max_new,
            compared=comparison.steps,  # the longer side's steps: the agreement's denominator
            **comparison.to_json(),
        )
    return row


def _generated(n: int, early: bool) -> str:
    return f"{n} (eos)" if early else str(n)


def prompt_table(title: str, rows: list[dict], summary: dict) -> Table:
    has_ref = "agreement" in summary
    t = Table(title=title)
    t.add_column("prompt", no_wrap=True, max_width=30)
    t.add_column("prompt tokens", justify="right")
    t.add_column("generated ours / ref" if has_ref else "generated", justify="right")
    if has_ref:
        for col in ("agreed / compared", "1st div", "top-k", "max|Δlp| agreed"):
            t.add_column(col, justify="right")
    t.add_column(("oracle" if summary["plan_exact"] else "lossy") + " |Δlogit| (tokens)", justify="right")
    for r in rows:
        generated = _generated(r["generated_ours"], r["stopped_early_ours"])
        if has_ref:
            generated += " / " + _generated(r["generated_reference"], r["stopped_early_reference"])
        cells = [_short(r["prompt"]), str(r["prompt_tokens"]), generated]
        if has_ref:
            first = "-" if r["first_divergence"] is None else str(r["first_divergence"])
            dlp = "n/a" if r["max_abs_dlogprob"] is None else f"{r['max_abs_dlogprob']:.1e}"
            agreed = f"{r['agreed']} / {r['compared']} ({r['agreement']:.0%})"
            cells += [agreed, first, "pass" if r["topk_pass"] else "[red]FAIL[/]", dlp]
        n = r["oracle_compared"]
        if summary["plan_exact"]:
            verdict = "pass" if r["oracle_pass"] else "[red]FAIL[/]"
            cells.append(f"{verdict} ({r['oracle_max_dlogit']:.0e}, {n})")
        else:
            cells.append(f"{r['oracle_max_dlogit']:.1e} ({n})")
        t.add_row(*cells)
    return t


def table_note(rows: list[dict], summary: dict) -> str:
    """What the token columns count (said once under the table)."""
    max_new = rows[0]["max_new_tokens"] if rows else "?"
    note = (
        f"generated: new tokens produced, at most max_new_tokens={max_new}; '(eos)': stopped early at its "
        "end-of-sequence token"
    )
    if "agreement" in summary:
        note += (
            "; compared: the steps the agreement counts, the longer side's (a side that stopped early has the other's "
            "extra steps counted as disagreement); agreed: the steps before the first divergence"
        )
    return note + "; the oracle column: the largest |Δlogit| over every token ours generated (their count)"


def print_prompt_table(console: Console, title: str, rows: list[dict], summary: dict) -> None:
    console.print(prompt_table(title, rows, summary))
    console.print(f"[dim]{table_note(rows, summary)}[/]", soft_wrap=True)


def _short(text: str, n: int = 30) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
