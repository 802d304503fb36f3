"""The loss curve of experiment=train: training loss (smoothed) and held-out probes, in bits per byte, per arch."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"hybrid": "tab:blue", "attention": "tab:orange"}
PROBE_STYLE = {"eval/shakespeare": ":", "eval/docstrings": "--", "unseen/pydoc": "-."}


def smooth(values: list[float], window: int = 25) -> list[float]:
    """Trailing mean over `window` steps (the per-batch loss is noisy: each batch mixes three sources)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_curve(histories: dict[str, Path], path: Path, title: str) -> Path:
    """One PNG: for every arch, training bits/byte against bytes seen, and its held-out probes as markers."""
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for arch, file in sorted(histories.items()):
        data = json.loads(Path(file).read_text())
        rows, color = data["history"], COLORS.get(arch, None)
        if not rows:
            continue
        x = [r["tokens"] / 1e6 for r in rows]
        ax.plot(
            x, smooth([r["bits_per_byte"] for r in rows]), color=color, lw=1.6, label=f"{arch}: train (25-step mean)"
        )
        for split, style in PROBE_STYLE.items():
            pts = [(p["tokens"] / 1e6, p[split]) for p in data["probes"] if split in p]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", ms=3, color=color, lw=1, label=f"{arch}: held-out {split}")
    ax.axhline(3.2, color="grey", lw=0.8, ls="-")
    ax.text(ax.get_xlim()[0], 3.22, " target on unseen prose: 3.2", color="grey", fontsize=8, va="bottom")
    ax.set_xlabel("training bytes seen (millions; one token = one byte)")
    ax.set_ylabel("next-byte loss (bits per byte; cut at 5,\nstarts at log2(384) = 8.6)")
    ax.set_ylim(1.0, 5.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
