"""experiment=study's results: one row per strategy, an honest verdict, the console table and the Pareto plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hybridcache.cache.plan import format_bytes

EXACT_KL = 1e-5          # mean KL (nats) below which a strategy counts as the same model as native
NEAR_PPL = 0.01          # relative perplexity increase that still counts as "near native"


def verdict(row: dict[str, Any], native: dict[str, Any], random_weights: bool) -> str:
    """A one-line, conservative reading of a strategy's numbers against native's."""
    if row.get("error"):
        return f"unavailable: {row['error']}"
    if row["name"] == native["name"]:
        return "reference" + (" (random weights: quality numbers are meaningless)" if random_weights else "")
    if row.get("same_plan"):
        return "exact: same plan as native on this model (nothing changes)"
    longest = str(max(int(k) for k in row["ppl"]))
    kl, d_ppl = row["kl"][longest], row["ppl"][longest] / native["ppl"][longest] - 1
    pk, pk_native = row["passkey_acc"], native["passkey_acc"]
    diverged = [int(L) for L, step in row["greedy_diverges_at"].items() if step is not None]
    parts = []
    if kl < EXACT_KL and not diverged and (pk is None or pk >= pk_native):
        parts.append("exact: same as native (up to float rounding)" if row["exact_cache"]
                     else "same as native here (a lossy cache, no measurable effect)")
    else:
        parts.append(f"{'near native' if abs(d_ppl) < NEAR_PPL else 'lossy'}: ppl {d_ppl:+.1%} at {longest} tokens, "
                     f"KL {kl:.3g}")
        if diverged:
            parts.append(f"greedy drifts from native ({min(diverged)}-token context)")
    if pk is not None and pk_native is not None and not random_weights:
        lost = sorted(t["distance"] for t in row["passkey"] if not t["correct"] and t["native_correct"])
        kept = sorted(t["distance"] for t in row["passkey"] if t["correct"])
        if lost:
            where = f" once it is {lost[0]}+ tokens back" + (f" (found at {kept[-1]})" if kept else "")
            parts.append(f"loses the passkey{where}")
        elif pk_native > 0:
            parts.append("keeps the passkey" if pk >= pk_native else f"passkey {pk:.0%} vs {pk_native:.0%}")
    if row["bytes_ratio"] < 0.999:
        parts.append(f"holds {row['bytes_ratio']:.0%} of native's bytes")
    elif row["bytes_ratio"] > 1.001:
        parts.append(f"holds MORE than native ({row['bytes_ratio']:.0%})")
    if random_weights:
        parts.append("random weights: only exactness is meaningful")
    return "; ".join(parts)


def print_table(console: Console, rows: list[dict[str, Any]], lengths: list[int], title: str) -> None:
    t = Table(title=title, show_lines=False)
    longest = str(max(lengths))
    t.add_column("strategy", style="bold")
    t.add_column(f"peak bytes ≤{longest}", justify="right")
    t.add_column("vs native", justify="right")
    for L in lengths:
        t.add_column(f"ppl @{L}", justify="right")
    t.add_column(f"KL @{longest}", justify="right")
    t.add_column(f"top-1 @{longest}", justify="right")
    t.add_column("greedy agree @" + "/".join(map(str, lengths)), justify="right")
    pk_lengths = next((list(r["passkey_by_length"]) for r in rows if r.get("passkey_by_length")), [])
    t.add_column("passkey" + (" @" + "/".join(pk_lengths) if pk_lengths else ""), justify="right")
    for r in rows:
        if r.get("error"):
            t.add_row(r["name"], *["-"] * (6 + len(lengths)))
            continue
        greedy = " ".join(f"{v:.0%}" for v in r["greedy_agreement"].values()) or "-"
        cells = r.get("passkey_by_length") or {}
        pk = " ".join(f"{c}/{n}" for c, n in cells.values()) if cells else "-"
        t.add_row(r["name"], format_bytes(r["bytes"]), f"{r['bytes_ratio']:.0%}",
                  *[f"{r['ppl'][str(L)]:.3f}" for L in lengths], f"{r['kl'][longest]:.2e}",
                  f"{r['top1'][longest]:.1%}", greedy, pk)
    console.print(t)
    console.print("[bold]verdicts[/]")
    for r in rows:
        console.print(f"  [bold]{r['name']}[/] {json.dumps(r['config'])}: {r['verdict']}", highlight=False)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both axes (lower is better on both)."""
    return [i for i, (x, y) in enumerate(points)
            if not any((x2 <= x and y2 <= y) and (x2 < x or y2 < y) for x2, y2 in points)]


def pareto_plot(rows: list[dict[str, Any]], lengths: list[int], path: Path, title: str) -> Path:
    """Cache bytes (vs native) against perplexity and passkey accuracy, the Pareto front joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error")]
    longest = str(max(lengths))
    has_passkey = any(r["passkey_trials"] for r in ok)
    fig, axes = plt.subplots(1, 2 if has_passkey else 1, figsize=(12 if has_passkey else 6.5, 4.8), squeeze=False)
    panels = [("perplexity @" + longest, ok, [r["ppl"][longest] for r in ok], True)]
    if has_passkey:  # only the strategies the passkey test ran for (experiment.passkey.strategies)
        probed = [r for r in ok if r["passkey_trials"]]
        panels.append(("passkey accuracy", probed, [r["passkey_acc"] for r in probed], False))
    for ax, (label, shown, ys, lower_better) in zip(axes[0], panels):
        xs = [100 * r["bytes_ratio"] for r in shown]
        ax.scatter(xs, ys, s=40, zorder=3)
        labels: dict[tuple[float, float], list[str]] = {}
        for x, y, r in zip(xs, ys, shown):  # strategies at the same point share one label
            labels.setdefault((round(x, 3), round(y, 6)), []).append(r["name"])
        for (x, y), names in labels.items():
            ax.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        front = pareto_front([(x, y if lower_better else -y) for x, y in zip(xs, ys)])
        front = sorted(front, key=lambda i: xs[i])
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="tab:red", label="Pareto front")
        ax.set_xlabel(f"peak cache bytes over {longest} tokens (% of native)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        if ys and all(y > 0 for y in ys) and lower_better and max(ys) / min(ys) > 20:
            ax.set_yscale("log")
        if not lower_better:
            ax.set_ylim(-0.05, 1.05)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def finite(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x
