"""PNG plots of benchmark results (matplotlib, no display needed) and their W&B copies (image + native plots)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

from experiments.core.figure_style import byte_unit, strategy_color  # noqa: E402
from experiments.core.results import save_figure  # noqa: E402

SYSTEMS = ("ours (compiled)", "ours (eager)", "hf", "vllm")


def bar_value(v: float) -> str:
    """A bar's label: three significant digits, never in exponent form (1000, not 1e+03)."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _valid(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _bar_order(rows: list[dict]) -> tuple[list[str], dict[str, dict]]:
    """The systems in bar order and each one's bar style. A llama.cpp row (one per precision) stands right after
    ours at the same precision (its `weights_format`), in that row's colour, hatched: the pair a ratio compares."""
    names = {r["system"] for r in rows}
    llama = {r["system"]: r.get("weights_format") for r in rows if r["system"].startswith("llama.cpp")}
    systems = [s for s in SYSTEMS if s in names]
    systems += sorted(names - set(systems) - set(llama))
    systems.sort(key=lambda s: not s.startswith("ours"))  # ours first (stable: the order above within each part)
    styles = {s: {"color": strategy_color(s)} for s in systems}
    for name, fmt in sorted(llama.items()):
        partner = next(
            (r["system"] for r in rows if r["system"].startswith("ours") and r.get("weights_format") == fmt), None
        )
        at = systems.index(partner) + 1 if partner in systems else len(systems)
        systems.insert(at, name)
        color = strategy_color(partner) if partner else strategy_color(name)
        styles[name] = {"facecolor": "white", "edgecolor": color, "hatch": "////", "linewidth": 1.0}
    return systems, styles


def throughput_bars(rows: list[dict], path: Path, context: str = "") -> Path:
    """Decode and prefill tokens/s, ours vs the references, per batch size. A row without a valid timing draws no
    bar but an "n/a" mark (a zero-height bar would read as "0 tokens/s")."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))
    batches = sorted({r["batch"] for r in rows})
    systems, styles = _bar_order(rows)
    width = 0.8 / max(len(systems), 1)
    for ax, metric, what in zip(axes, ("decode_tok_s", "prefill_tok_s"), ("decode", "prefill")):
        for i, system in enumerate(systems):
            xs = [b + i * width for b in range(len(batches))]
            values = [
                next((r.get(metric) for r in rows if r["system"] == system and r["batch"] == b), None) for b in batches
            ]
            ok = [(x, v) for x, v in zip(xs, values) if _valid(v)]
            bars = ax.bar([x for x, _ in ok], [v for _, v in ok], width, label=system, **styles[system])
            ax.bar_label(bars, labels=[bar_value(v) for _, v in ok], fontsize=7, padding=1)
            for x, v in zip(xs, values):
                if not _valid(v):  # the bar's own slot, at the panel's foot: y in axes units (a log axis has no 0)
                    ax.text(
                        x,
                        0.01,
                        "n/a",
                        transform=ax.get_xaxis_transform(),
                        ha="center",
                        va="bottom",
                        fontsize=6,
                        color=styles[system].get("edgecolor") or styles[system]["color"],
                        bbox={"boxstyle": "square,pad=0.2", "fill": False, "linestyle": "--", "linewidth": 0.6},
                        clip_on=True,
                    )
        ax.set_xticks(
            [b + width * (len(systems) - 1) / 2 for b in range(len(batches))], [f"batch {b}" for b in batches]
        )
        # every slot inside the panel, a missing bar's too (autoscaling sees only the bars drawn)
        ax.set_xlim(-width, len(batches) - 1 + len(systems) * width)
        ax.set_xlabel("batch size (sequences decoded together)")
        valid = [r[metric] for r in rows if _valid(r.get(metric))]
        spread = len(valid) > 1 and max(valid) / min(valid) > 20
        if spread:  # a 100x gap would flatten the slower bars to nothing on a linear axis
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 1, 2, 5, 10, 20, 50 ...: plain numbers
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel(f"{what} throughput (tokens/s, whole batch{'; log scale' if spread else ''})")
        ax.set_title(f"{what}: tokens per second (higher is better)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    # one legend below both panels: inside an axis it covers bars (the two panels share their systems)
    # handles from the styles, not from a panel: a system with no valid bar in that panel (all "n/a") would show a
    # handle of the colour cycle's next colour instead of its own
    handles = [Patch(label=system, **styles[system]) for system in systems]
    labels = list(systems)
    columns = min(4, max(len(labels), 1))
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    legend_rows = -(-len(labels) // columns)
    fig.suptitle("Throughput, ours vs references" + (f"\n{context}" if context else ""), fontsize=9)
    fig.tight_layout(rect=(0, 0.02 + 0.055 * legend_rows, 1, 1))
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def rss_growth(rows: list[dict]) -> list[float]:
    """Each row's peak RSS minus the RSS its process had with the model loaded, in bytes: what prefill and decode
    added (the absolute peaks differ by a fraction of a percent, so an absolute axis is unreadable)."""
    return [max(0.0, (r["peak_rss_mib"] - r.get("loaded_rss_mib", 0.0)) * (1 << 20)) for r in rows]


def scaling_lines(rows: list[dict], path: Path, context: str = "") -> Path:
    """Per-token decode time and the RSS a run added on top of its loaded model vs prompt length, one line per
    strategy."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    growth = rss_growth(rows)
    scale, unit = byte_unit(max(growth, default=0.0))
    for strategy in sorted({r["strategy"] for r in rows}):
        points = sorted((r["tokens"], g, r) for r, g in zip(rows, growth) if r["strategy"] == strategy)
        xs = [t for t, _, _ in points]
        style = {"marker": "o", "label": strategy, "color": strategy_color(strategy)}
        axes[0].plot(xs, [r["decode_ms_per_token"] for _, _, r in points], **style)
        axes[1].plot(xs, [g / scale for _, g, _ in points], **style)
    axes[0].set_ylabel("decode time per token (ms)")
    axes[0].set_title("decode latency (lower is better)", fontsize=10)
    axes[1].set_ylabel(f"peak RSS above the loaded model ({unit})")
    loaded = [r["loaded_rss_mib"] for r in rows if "loaded_rss_mib" in r]
    base = f"\n(the model loaded: {min(loaded):.0f}-{max(loaded):.0f} MiB RSS per process)" if loaded else ""
    axes[1].set_title(f"memory a run adds: prefill + decode (lower is better){base}", fontsize=10)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.yaxis.set_major_locator(MaxNLocator(6))
        ax.yaxis.get_major_formatter().set_useOffset(False)
        ax.set_ylim(0, 1.15 * max((y for line in ax.get_lines() for y in line.get_ydata()), default=1.0) or 1.0)
        ax.set_xlabel("prompt length (tokens, prefilled in chunks)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle("Long context: each point in its own process" + (f"\n{context}" if context else ""), fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def log_benchmark(tracker: Any, rows: list[dict], scaling: list[dict], plots: list[Path]) -> None:
    """The benchmark's figures to W&B: each PNG as an image, and the same numbers as native W&B plots (a table plus
    bar/line charts) that runs can be compared on in the W&B UI."""
    for p in plots:
        tracker.image(Path(p).stem, p)
    tracker.bar(
        "throughput/decode_tok_s",
        [f"{r['system']} b{r['batch']}" for r in rows if _valid(r.get("decode_tok_s"))],
        [r["decode_tok_s"] for r in rows if _valid(r.get("decode_tok_s"))],
        label="system, batch",
        value="decode tokens/s",
        title="decode tokens/s",
    )
    if scaling:
        growth = rss_growth(scaling)
        tracker.line(
            "long_context/decode_ms_per_token",
            [(r["strategy"], r["tokens"], r["decode_ms_per_token"]) for r in scaling],
            x="prompt tokens",
            y="decode ms per token",
            title="decode ms per token vs prompt length",
        )
        tracker.line(
            "long_context/rss_added_mib",
            [(r["strategy"], r["tokens"], g / (1 << 20)) for r, g in zip(scaling, growth)],
            x="prompt tokens",
            y="peak RSS above the loaded model (MiB)",
            title="RSS a run adds vs prompt length",
        )
