"""PNG plots of benchmark results (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def throughput_bars(rows: list[dict], path: Path) -> Path:
    """Decode and prefill tokens/s, ours vs the references, per batch size."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("decode_tok_s", "prefill_tok_s")):
        batches = sorted({r["batch"] for r in rows})
        systems = [s for s in ("ours (compiled)", "ours (eager)", "hf", "vllm") if any(r["system"] == s for r in rows)]
        width = 0.8 / max(len(systems), 1)
        for i, system in enumerate(systems):
            values = [
                next((r[metric] for r in rows if r["system"] == system and r["batch"] == b and r.get(metric)), 0)
                for b in batches
            ]
            ax.bar([b + i * width for b in range(len(batches))], values, width, label=system)
        ax.set_xticks(
            [b + width * (len(systems) - 1) / 2 for b in range(len(batches))], [f"batch {b}" for b in batches]
        )
        ax.set_title(metric.replace("_tok_s", " tokens/s"))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scaling_lines(rows: list[dict], path: Path) -> Path:
    """Per-token decode time and peak RSS vs prompt length, one line per strategy."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for strategy in sorted({r["strategy"] for r in rows}):
        points = sorted((r["tokens"], r) for r in rows if r["strategy"] == strategy)
        xs = [t for t, _ in points]
        axes[0].plot(xs, [r["decode_ms_per_token"] for _, r in points], marker="o", label=strategy)
        axes[1].plot(xs, [r["peak_rss_mib"] for _, r in points], marker="o", label=strategy)
    for ax, title in zip(axes, ("decode ms / token", "peak RSS (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
