"""experiment=long_context's tables (RULER per task and length, peak RSS per length, per strategy) and its NIAH
heatmaps (needle depth x prompt length, one panel per strategy, the score written in each cell)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import experiments.core.figure_style  # noqa: F401 - the Agg backend, set once there
from experiments.core.results import save_figure


def _lengths(rows: list[dict], key: str) -> list[str]:
    return sorted({L for r in rows for by in r.get(key, {}).values() for L in by}, key=int)


def print_tables(console: Console, rows: list[dict[str, Any]], agreement: dict | None) -> None:
    ran = [r for r in rows if not r.get("error") and not r.get("same_plan")]
    tasks = list(dict.fromkeys(t for r in ran for t in r.get("ruler", {})))
    lengths = _lengths(ran, "ruler")
    if tasks:
        t = Table(title="RULER: mean score (0-100) per task and prompt length")
        t.add_column("task")
        t.add_column("tokens", justify="right")
        for r in ran:
            t.add_column(r["name"], justify="right")
        for task in tasks:
            for L in lengths:
                t.add_row(task, L, *[_cell(r["ruler"].get(task, {}).get(L)) for r in ran])
        for L in lengths:
            means = [_mean([by[L] for by in r["ruler"].values() if L in by]) for r in ran]
            t.add_row("[bold]mean[/]", L, *[f"[bold]{_cell(m)}[/]" for m in means])
        console.print(t)
    t = Table(title="Peak RSS (MiB) of each (strategy, length) worker process; prompt seconds (mean)")
    t.add_column("strategy")
    groups = sorted({L for r in ran for L in r.get("groups", {})}, key=int)
    for L in groups:
        t.add_column(f"{L} tok", justify="right")
    for r in ran:
        cells = []
        for L in groups:
            g = r["groups"].get(L)
            secs = [x["seconds"] for x in r["trials"] if str(x["length"]) == L]
            cells.append("-" if g is None else f"{g['peak_rss_mib']:.0f} MiB, {_mean(secs):.0f} s")
        t.add_row(r["name"], *cells)
    console.print(t)
    for r in rows:
        if r.get("error"):
            console.print(f"[yellow]{r['name']}: not run ({r['error']})[/]")
    same = [r["name"] for r in rows if r.get("same_plan")]
    if same:
        console.print(f"not run, the same cache plan as the baseline on this model: {', '.join(same)}")
    if agreement is not None:
        console.print(
            f"RULER's own scoring: {agreement['equal']}/{agreement['samples']} answers scored the same as ours"
        )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def grid_of(run: dict[str, Any], task: str) -> dict[str, dict[str, float]]:
    """depth -> length -> mean score over every trial of `task` (RULER's or the heatmap's: the same prompts)."""
    cells: dict[str, dict[str, list[float]]] = {}
    for t in run.get("trials", []):
        if t["task"] == task and t["depth"] is not None:
            cells.setdefault(str(t["depth"]), {}).setdefault(str(t["length"]), []).append(t["score"])
    return {d: {L: sum(v) / len(v) for L, v in by.items()} for d, by in cells.items()}


def niah_heatmaps(rows: list[dict[str, Any]], path: Path, title: str, task: str | None = None) -> Path | None:
    """One panel per strategy with NIAH cells: rows the needle's depth (0 = start of the haystack), columns the
    prompt length, colour and text the mean RULER score (0-100); a cell not run is grey. With `task`, the cells
    come from every trial of that task (the RULER part's too), else from the heatmap part."""
    import matplotlib.pyplot as plt

    if task:
        rows = [{**r, "niah": grid_of(r, task)} for r in rows]
    ran = [r for r in rows if r.get("niah")]
    if not ran:
        return None
    depths = sorted({d for r in ran for d in r["niah"]}, key=float)
    lengths = _lengths(ran, "niah")
    cols = min(3, len(ran))
    nrows = math.ceil(len(ran) / cols)
    fig, axes = plt.subplots(
        nrows,
        cols,
        figsize=((0.9 * len(lengths) + 1.3) * cols + 1.2, (0.45 * len(depths) + 1.2) * nrows + 0.9),
        squeeze=False,
        layout="constrained",
    )
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#e0e0e0")  # a cell not run: grey
    image = None
    for ax, r in zip(axes.flat, ran):
        grid = [[r["niah"].get(d, {}).get(L, math.nan) for L in lengths] for d in depths]  # [depths, lengths]
        image = ax.imshow(grid, cmap=cmap, vmin=0, vmax=100, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    dark = v < 20 or v > 85  # the ends of RdYlGn are dark: white text there
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=9, color="white" if dark else "black")
        ax.set_title(r["name"], fontsize=10)
        ax.set_xticks(range(len(lengths)), [_k(L) for L in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{float(d):g}" for d in depths], fontsize=8)
        ax.set_xlabel("prompt tokens", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
    for ax in list(axes.flat)[len(ran) :]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.8, label="RULER score (0-100)")
    fig.suptitle(title, fontsize=9)
    out = save_figure(fig, path, dpi=110)
    plt.close(fig)
    return out


def _k(L: str) -> str:
    n = int(L)
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def merged(paths: list[Path]) -> list[dict[str, Any]]:
    """The strategies of several long_context.json files (runs of different strategies): of a name, the first that
    ran a prompt (a stopped run lists strategies it never reached)."""
    import json

    rows: dict[str, dict] = {}
    for p in paths:
        for r in json.loads(Path(p).read_text())["strategies"]:
            if r["name"] not in rows or (r.get("trials") and not rows[r["name"]].get("trials")):
                rows[r["name"]] = r
    return list(rows.values())


def markdown(rows: list[dict[str, Any]]) -> str:
    """RULER per task and length (one column per strategy), then peak RSS and mean seconds per prompt per length."""
    ran = [r for r in rows if r.get("trials")]
    tasks = list(dict.fromkeys(t for r in ran for t in r.get("ruler", {})))
    lengths = _lengths(ran, "ruler")
    out = ["| task | tokens | " + " | ".join(r["name"] for r in ran) + " |", "|---|---:|" + "---:|" * len(ran)]
    for task in tasks:
        for L in lengths:
            out.append(f"| {task} | {L} | " + " | ".join(_cell(r["ruler"].get(task, {}).get(L)) for r in ran) + " |")
    groups = sorted({L for r in ran for L in r["groups"]}, key=int)
    out += ["", "| strategy | " + " | ".join(f"{L} tokens" for L in groups) + " |", "|---|" + "---:|" * len(groups)]
    for r in ran:
        cells = []
        for L in groups:
            g = r["groups"].get(L)
            secs = [x["seconds"] for x in r["trials"] if str(x["length"]) == L]
            cells.append("-" if g is None else f"{g['peak_rss_mib']:.0f} MiB, {_mean(secs):.0f} s/prompt")
        out.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":  # python -m experiments.long_context.report FIGURE.png TITLE TASK RUN/long_context.json ...
    import sys

    rows = merged([Path(p) for p in sys.argv[4:]])
    print(markdown(rows))
    print(niah_heatmaps(rows, Path(sys.argv[1]), sys.argv[2], sys.argv[3]))
