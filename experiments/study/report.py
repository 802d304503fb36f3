"""experiment=study's results: one row per strategy, an honest verdict, the console table and the Pareto plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hybridcache.cache.core.plan import format_bytes

EXACT_KL = 1e-5  # mean KL (nats) below which a strategy counts as the same model as native
NEAR_PPL = 0.01  # relative perplexity increase that still counts as "near native"


def headline(row: dict[str, Any]) -> tuple[str, float, float, str]:
    """(length, KL, perplexity, which) a verdict reads: the blockwise read, or kvpress's protocol for a strategy
    that compresses after the prefill (it has no blockwise numbers)."""
    if row["ppl"]:
        longest = str(max(int(k) for k in row["ppl"]))
        return longest, row["kl"][longest], row["ppl"][longest], f"at {longest} tokens"
    longest = str(max(int(k) for k in row["continuation_ppl"]))
    return longest, row["continuation_kl"][longest], row["continuation_ppl"][longest], f"after a {longest}-token prompt"


PARTS = {
    "ablate_state": "recurrent states",
    "ablate_ssm": "SSM / LRU / delta-rule states",
    "ablate_attention": "attention beyond the current block",
}


def control_reading(row: dict[str, Any], control: dict[str, Any], kl: float, insensitive_kl: float) -> tuple[str, bool]:
    """(what the strategy's KL means next to its control's, whether the model is insensitive to that part): the
    control drops the part of the cache the strategy changes; below `insensitive_kl` the model barely uses it, and a
    small effect there is no evidence that the strategy is free."""
    part = PARTS.get(control["name"], control["name"])
    key = "kl" if row["ppl"] and control["ppl"] else "continuation_kl"
    values = control.get(key) or {}
    longest = str(max(int(k) for k in values)) if values else None
    ckl = values.get(longest) if longest else None
    if ckl is None or not math.isfinite(ckl):
        return f"control {control['name']} not measured", False
    row["control_kl"] = ckl
    if ckl < insensitive_kl:
        return (
            f"NO CONCLUSION: the model barely uses its {part} (dropping them, {control['name']}, costs KL "
            f"{ckl:.2g} < {insensitive_kl:g}), so a small effect here does not show the strategy is free"
        ), True
    share = kl / ckl if ckl > 0 else float("inf")
    return f"{share:.1%} of the KL of dropping its {part} ({control['name']}: KL {ckl:.3g})", False


def verdict(
    row: dict[str, Any],
    native: dict[str, Any],
    random_weights: bool,
    control: dict[str, Any] | None = None,
    insensitive_kl: float = 1e-3,
) -> str:
    """A one-line, conservative reading of a strategy's numbers against native's, and against its control's (the
    ablation of the part of the cache it changes), when there is one."""
    if row.get("error"):
        return f"unavailable: {row['error']}"
    if row["name"] == native["name"]:
        return "baseline" + (" (random weights: quality numbers are meaningless)" if random_weights else "")
    if row.get("same_plan"):
        return "exact: same plan as native on this model (nothing changes)"
    if not row["ppl"] and not row["continuation_ppl"]:
        return "compresses after the prefill: measured by kvpress's protocol, which is off (experiment.continuation=0)"
    longest, kl, ppl, where = headline(row)
    d_ppl = ppl / (native["ppl"] if row["ppl"] else native["continuation_ppl"])[longest] - 1
    reading, insensitive = control_reading(row, control, kl, insensitive_kl) if control else ("", False)
    pk, pk_native = row["passkey_acc"], native["passkey_acc"]
    diverged = [int(L) for L, step in row["greedy_diverges_at"].items() if step is not None]
    parts = ["compresses after the prefill (kvpress's protocol)"] if row.get("protocol") == "prefill" else []
    if insensitive:
        parts.insert(0, reading)
    if kl < EXACT_KL and not diverged and (pk is None or pk >= pk_native):
        parts.append(
            "exact: same as native (up to float rounding)"
            if row["exact_cache"]
            else "same as native here (a lossy cache, no measurable effect)"
        )
    else:
        parts.append(f"{'near native' if abs(d_ppl) < NEAR_PPL else 'lossy'}: ppl {d_ppl:+.1%} {where}, KL {kl:.3g}")
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
    if row.get("mqar_acc") is not None and native.get("mqar_acc") and not random_weights:
        queries = [q for t in row["mqar_trials"] for q in t["queries"]]
        lost = sorted(q["distance"] for q in queries if q["native_correct"] and not q["correct"])
        if len(lost) > 0.05 * sum(q["native_correct"] for q in queries):  # more than a stray query
            kept = [q["distance"] for q in queries if q["correct"] and q["distance"] > lost[len(lost) // 2]]
            parts.append(
                f"MQAR recall {row['mqar_acc']:.0%} vs native {native['mqar_acc']:.0%} (half the queries it "
                f"loses are {lost[len(lost) // 2]}+ tokens back" + (")" if kept else "; none recalled beyond)")
            )
        else:
            parts.append(f"keeps MQAR recall ({row['mqar_acc']:.0%} vs native {native['mqar_acc']:.0%})")
    if row.get("ruler_mean") is not None and native.get("ruler_mean") is not None and not random_weights:
        parts.append(f"RULER {row['ruler_mean']:.0f} vs native {native['ruler_mean']:.0f}")
    if reading and not insensitive:
        parts.append(reading)
    if row["bytes_ratio"] < 0.999:
        parts.append(f"holds {row['bytes_ratio']:.0%} of native's bytes" + saved_where(row))
    elif row["bytes_ratio"] > 1.001:
        parts.append(f"holds MORE than native ({row['bytes_ratio']:.0%})")
    if random_weights:
        parts.append("random weights: only exactness is meaningful")
    return "; ".join(parts)


def saved_where(row: dict[str, Any]) -> str:
    """Where a smaller cache's saving comes from, on the whole cache: ", saving 24% of the whole cache (its states
    -70%, KV unchanged)"."""
    if row.get("saving") is None:
        return ""
    what = []
    for part, key in (("KV", "kv_saving"), ("states", "state_saving")):
        x = row.get(key)
        if x is not None:
            what.append(f"{part} unchanged" if abs(x) < 5e-4 else f"its {part} {-x:+.0%}")
    return f", saving {row['saving']:.0%} of the whole cache" + (f" ({', '.join(what)})" if what else "")


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def split_cells(row: dict[str, Any]) -> list[str]:
    """The row's bytes as keys/values and recurrent states, and its saving on the whole cache next to the saving on
    each part (a part native does not hold: "-")."""
    if row.get("kv_bytes") is None:  # a row written before the split existed
        return ["-", "-"]
    return [
        f"{format_bytes(row['kv_bytes'])} / {format_bytes(row['state_bytes'])}",
        f"{_share(row['saving'])} ({_share(row['kv_saving'])}, {_share(row['state_saving'])})",
    ]


def _cell(values: dict[str, float], key: str, fmt: str) -> str:
    return format(values[key], fmt) if key in values else "-"


def print_table(console: Console, rows: list[dict[str, Any]], lengths: list[int], n_cont: int, title: str) -> None:
    """Two tables: bytes against the blockwise read and the probes; kvpress's protocol and the references."""
    t = Table(title=title, show_lines=False)
    longest = str(max(lengths))
    t.add_column("strategy", style="bold")
    t.add_column(f"peak bytes ≤{longest}", justify="right")
    t.add_column("vs native", justify="right")
    t.add_column("KV / states", justify="right")
    t.add_column("saved: whole cache (KV, states)", justify="right")
    for L in lengths:
        t.add_column(f"ppl @{L}", justify="right")
    t.add_column(f"KL @{longest}", justify="right")
    t.add_column(f"top-1 @{longest}", justify="right")
    t.add_column("greedy agree @" + "/".join(map(str, lengths)), justify="right")
    pk_lengths = next((list(r["passkey_by_length"]) for r in rows if r.get("passkey_by_length")), [])
    t.add_column("passkey" + (" @" + "/".join(pk_lengths) if pk_lengths else ""), justify="right")
    t.add_column("MQAR", justify="right")
    t.add_column("RULER", justify="right")
    for r in rows:
        if r.get("error"):
            t.add_row(r["name"], *["-"] * (10 + len(lengths)))
            continue
        greedy = " ".join(f"{v:.0%}" for v in r["greedy_agreement"].values()) or "-"
        cells = r.get("passkey_by_length") or {}
        pk = " ".join(f"{c}/{n}" for c, n in cells.values()) if cells else "-"
        prefill = r.get("protocol") == "prefill"
        t.add_row(
            r["name"] + ("*" if prefill else ""),
            format_bytes(r["bytes"]),
            f"{r['bytes_ratio']:.0%}",
            *split_cells(r),
            *[_cell(r["ppl"], str(L), ".4g") for L in lengths],
            _cell(r["kl"], longest, ".2e"),
            _cell(r["top1"], longest, ".1%"),
            greedy,
            pk,
            "-" if r.get("mqar_acc") is None else f"{r['mqar_acc']:.0%}",
            "-" if r.get("ruler_mean") is None else f"{r['ruler_mean']:.1f}",
        )
    console.print(t)
    if any(r.get("protocol") == "prefill" for r in rows):
        console.print(
            "* compresses once after the prompt (kvpress's presses): a blockwise read would compress only "
            "its first block, so it has no blockwise numbers; its greedy tokens follow a one-block prompt, "
            "its passkey/RULER prompts are prefilled in one block; see kvpress's protocol below"
        )
    t = Table(
        title=(
            f"kvpress's protocol: the {n_cont} tokens after an L-token prompt fed in one block"
            if n_cont
            else "references"
        )
        + "; what each strategy was checked against"
    )
    t.add_column("strategy", style="bold")
    if n_cont:
        for L in lengths:
            t.add_column(f"ppl after {L}", justify="right")
        t.add_column(f"KL after {longest}", justify="right")
        t.add_column(f"top-1 after {longest}", justify="right")
    t.add_column("reference", overflow="fold")
    t.add_column("agreement", overflow="fold")
    for r in rows:
        ref = [r.get("reference") or "", "" if r.get("agreement") is None else str(r["agreement"])]
        ok = n_cont and not r.get("error")
        cont = (
            [
                *[_cell(r["continuation_ppl"], str(L), ".4g") for L in lengths],
                _cell(r["continuation_kl"], longest, ".2e"),
                _cell(r["continuation_top1"], longest, ".1%"),
            ]
            if ok
            else ["-"] * (len(lengths) + 2 if n_cont else 0)
        )
        t.add_row(r["name"], *cont, *ref)
    console.print(t)
    console.print("[bold]verdicts[/]")
    for r in rows:
        console.print(f"  [bold]{r['name']}[/] {json.dumps(r['config'])}: {r['verdict']}", highlight=False)


def print_ruler_table(console: Console, rows: list[dict[str, Any]]) -> None:
    """RULER's scores (0-100, under each task's RULER metric): one row per task and prompt length, one column per
    strategy it ran for."""
    from experiments.long_context.ruler import metric_name

    ran = [r for r in rows if r.get("ruler")]
    if not ran:
        return
    cells = list(dict.fromkeys((task, L) for r in ran for task, by in r["ruler"].items() for L in by))
    t = Table(title="RULER: mean score (0-100) per task and prompt length")
    t.add_column("task")
    t.add_column("tokens", justify="right")
    t.add_column("metric")
    for r in ran:
        t.add_column(r["name"] + ("*" if r.get("protocol") == "prefill" else ""), justify="right")
    for task, L in cells:
        t.add_row(
            task,
            L,
            metric_name(task),
            *[f"{r['ruler'][task][L]:.0f}" if L in r["ruler"].get(task, {}) else "-" for r in ran],
        )
    t.add_row("[bold]mean[/]", "", "", *[f"[bold]{r['ruler_mean']:.1f}[/]" for r in ran])
    console.print(t)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both axes (lower is better on both)."""
    return [
        i
        for i, (x, y) in enumerate(points)
        if not any((x2 <= x and y2 <= y) and (x2 < x or y2 < y) for x2, y2 in points)
    ]


def _label_groups(xs: list[float], ys: list[float], names: list[str], span: float) -> list[tuple[float, float, str]]:
    """Strategies at (nearly) the same point share one label, two names a line."""
    groups: list[tuple[float, float, list[str]]] = []
    for x, y, name in zip(xs, ys, names):
        near = next((g for g in groups if abs(g[0] - x) < 1.5 and abs(g[1] - y) < 0.02 * span), None)
        if near:
            near[2].append(name)
        else:
            groups.append((x, y, [name]))
    return [(x, y, "\n".join(", ".join(n[i : i + 2]) for i in range(0, len(n), 2))) for x, y, n in groups]


def pareto_plot(rows: list[dict[str, Any]], lengths: list[int], path: Path, title: str, n_cont: int = 0) -> Path:
    """Cache bytes (vs native) against each quality measure (blockwise perplexity, kvpress's protocol, passkey,
    MQAR, RULER), one panel each, every strategy in its own colour (experiments/core/figure_style.py), labels placed
    so none overprints another, the Pareto front joined and ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.core.figure_style import place_labels, strategy_color
    from experiments.core.results import save_figure

    ok = [r for r in rows if not r.get("error")]
    longest = str(max(lengths))
    panels = []  # (y label, rows shown, their values, lower is better)
    blockwise = [r for r in ok if longest in r["ppl"]]
    if blockwise:
        ppl = [r["ppl"][longest] for r in blockwise]
        panels.append(
            (f"perplexity over the first {longest} tokens\n(read in blocks; lower is better)", blockwise, ppl, True)
        )
    kvpress = [r for r in ok if longest in r.get("continuation_ppl", {})]
    if n_cont and kvpress:
        label = f"perplexity of the {n_cont} tokens after a {longest}-token\nprompt (kvpress protocol; lower is better)"
        panels.append((label, kvpress, [r["continuation_ppl"][longest] for r in kvpress], True))
    probed = [r for r in ok if r["passkey_trials"]]  # only the strategies a probe ran for
    if probed:
        panels.append(("passkey accuracy (share of trials)", probed, [r["passkey_acc"] for r in probed], False))
    recalled = [r for r in ok if r.get("mqar_acc") is not None]
    if recalled:
        panels.append(("MQAR recall (share of queries)", recalled, [r["mqar_acc"] for r in recalled], False))
    scored = [r for r in ok if r.get("ruler_mean") is not None]
    if scored:
        panels.append(("RULER score (mean over tasks, 0-100)", scored, [r["ruler_mean"] for r in scored], False))
    cols = min(len(panels), 2)
    grid = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(grid, cols, figsize=(7 * cols, 4.8 * grid + 0.6), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    drawn = []
    for ax, (label, shown, ys, lower_better) in zip(axes.flat, panels):
        xs = [100 * r["bytes_ratio"] for r in shown]
        control = [r["name"] in PARTS for r in shown]  # the controls: what a part is worth, not options to pick
        for is_control, marker in ((False, "o"), (True, "s")):
            idx = [i for i, c in enumerate(control) if c == is_control]
            if idx:
                ax.scatter(
                    [xs[i] for i in idx],
                    [ys[i] for i in idx],
                    s=40,
                    marker=marker,
                    zorder=3,
                    c=[strategy_color(shown[i]["name"]) for i in idx],
                    edgecolors="black",
                    lw=0.4,
                    label="control (a part of the cache dropped; not on the front)" if is_control else None,
                )
        options = [i for i, c in enumerate(control) if not c]
        points = [(xs[i], ys[i] if lower_better else -ys[i]) for i in options]
        front = sorted((options[i] for i in pareto_front(points)), key=lambda i: xs[i])
        ax.plot(
            [xs[i] for i in front],
            [ys[i] for i in front],
            "--",
            color="tab:red",
            marker="o",
            ms=11,
            mfc="none",
            zorder=2,
            label="Pareto front (ringed" + (", joined)" if len(front) > 1 else "; one point)"),
        )
        ax.set_xlim(0, max(108, max(xs) + 8))
        ax.set_xlabel(f"peak cache bytes over {longest} tokens (% of native's bytes)")
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", bbox_to_anchor=(1, 1), fontsize=8, frameon=False, borderaxespad=0.2)
        if ys and all(y > 0 for y in ys) and lower_better and max(ys) / min(ys) > 20:
            ax.set_yscale("log")
        if not lower_better:
            top = 100 if "RULER" in label else 1
            ax.set_ylim(-0.08 * top, 1.1 * top)
        else:
            lo, hi = min(ys), max(ys)
            margin = 0.15 * ((hi - lo) or abs(hi) * 0.05 or 1.0)
            if ax.get_yscale() == "linear":
                ax.set_ylim(lo - margin, hi + margin)
        drawn.append((ax, xs, ys, shown))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    for ax, xs, ys, shown in drawn:  # after the layout: label offsets are in points, the axes must not move
        span = (max(ys) - min(ys)) or abs(max(ys)) or 1.0
        groups = _label_groups(xs, ys, [r["name"] for r in shown], span)
        place_labels(ax, [(x, y) for x, y, _ in groups], [t for _, _, t in groups])
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def finite(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def log_study(tracker: Any, rows: list[dict[str, Any]], lengths: list[int], plot: Path) -> None:
    """study_pareto.png to W&B as an image, and each of its panels as a native scatter plot (bytes vs quality)."""
    tracker.image("study_pareto", plot)
    ok = [r for r in rows if not r.get("error")]
    longest = str(max(lengths))
    x = "cache bytes (% of native)"
    measures = {
        f"perplexity @{longest}": lambda r: r["ppl"].get(longest),
        f"kvpress perplexity @{longest}": lambda r: (r.get("continuation_ppl") or {}).get(longest),
        "passkey accuracy": lambda r: r.get("passkey_acc") if r.get("passkey_trials") else None,
        "MQAR recall": lambda r: r.get("mqar_acc"),
        "RULER score": lambda r: r.get("ruler_mean"),
    }
    for measure, get in measures.items():
        points = [(r["name"], 100 * r["bytes_ratio"], get(r)) for r in ok if finite(get(r)) is not None]
        if points:
            key = "pareto/" + measure.split(" @")[0].replace(" ", "_")
            tracker.scatter(key, points, x, measure, title=f"{measure} vs {x}", label="strategy")
