"""Console summaries for experiments."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hybridcache.cache.plan import CachePlan, format_bytes


def type_bytes(plan: CachePlan, batch: int, tokens: int) -> dict[str, int]:
    """Bytes a plan holds per cache type at (batch, tokens)."""
    out: dict[str, int] = defaultdict(int)
    for p in plan.layers:
        out[p.type] += p.spec.held_nbytes(batch, tokens)
    return dict(out)


def _short(text: str, n: int = 30) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def print_summary(console: Console, cfg, rows: list[dict], summary: dict, run_dir: Path | None, json_path: Path) -> None:
    has_ref = "agreement" in summary
    t = Table(title=f"{cfg.model.family} · cache={cfg.cache_name} · reference={cfg.reference.name}" if "cache_name" in cfg
              else f"{cfg.model.family} · reference={cfg.reference.name}")
    t.add_column("prompt", no_wrap=True, max_width=30)
    t.add_column("tokens", justify="right")
    if has_ref:
        for col in ("agree", "1st div", "top-k", "max|Δlp|"):
            t.add_column(col, justify="right")
    t.add_column("oracle", justify="right")
    for r in rows:
        cells = [_short(r["prompt"]), f"{r['prompt_tokens']}+{r['new_tokens']}"]
        if has_ref:
            first = "-" if r["first_divergence"] is None else str(r["first_divergence"])
            cells += [f"{r['agreement']:.0%}", first, "pass" if r["topk_pass"] else "[red]FAIL[/]",
                      f"{r['max_abs_dlogprob']:.1e}"]
        cells.append("pass" if r["oracle_pass"] else f"[red]FAIL[/] ({r['oracle_max_dlogit']:.1e})")
        t.add_row(*cells)
    console.print(t)
    lines = []
    if has_ref:
        lines.append(f"agreement with {cfg.reference.name}: {summary['agreement']:.1%}   top-k pass rate: "
                     f"{summary['pass_rate']:.0%}   tokens/s ours {summary['tokens_per_s/ours']:.0f} vs "
                     f"{summary['tokens_per_s/reference']:.0f}")
    verdict = "[green]passes[/]" if summary["oracle_pass"] else "[bold red]FAILS: the cache is wrong (a bug)[/]"
    lines.append(f"oracle (cached == use_cache=False, same strategy): {verdict}, max |Δlogit| "
                 f"{summary['oracle_max_dlogit']:.1e}")
    if has_ref and summary["oracle_pass"] and summary["agreement"] < 1:
        lines.append("the oracle passes, so the difference from the reference is the strategy's effect on the model")
    lines.append(f"cache bytes held (longest prompt): {format_bytes(summary['cache_bytes/held'])} vs "
                 f"{format_bytes(summary['cache_bytes/native'])} with the native strategy")
    lines.append(f"W&B run: {run_dir if run_dir else 'disabled'}" + ("   (sync: wandb sync DIR)" if run_dir else ""))
    lines.append(f"results: {json_path}")
    for line in lines:
        console.print(line)
