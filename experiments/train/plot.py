"""The loss curve of experiment=train: training loss (smoothed) and held-out probes, in bits per byte, per arch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.core.figure_style import strategy_color  # noqa: E402
from experiments.core.results import save_figure  # noqa: E402

# what the title line says beyond the caller's (model, data, machine): the weights and the dtype trained in
TRAINED = "weights: trained by this run from a random init · float32"
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
        rows, color = data["history"], strategy_color(arch)
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
    ax.annotate(  # at the right end, on a white box: the curves cross the line further left
        "target on unseen prose: 3.2 bits/byte",
        (1.0, 3.2),
        xycoords=("axes fraction", "data"),
        xytext=(-4, 3),
        textcoords="offset points",
        ha="right",
        va="bottom",
        color="0.3",
        fontsize=8,
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
    )
    ax.set_xlabel("training bytes seen (millions; one token = one byte)")
    ax.set_ylabel("next-byte loss (bits per byte; cut at 5,\nstarts at log2(384) = 8.6)")
    ax.set_ylim(1.0, 5.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(f"{title}\n{TRAINED}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def log_loss_curve(tracker: Any, histories: dict[str, Path], path: Path) -> None:
    """loss_curve.png to W&B as an image, and the training and held-out curves of every arch as native line plots
    (one line per arch and split) that runs compare on in the W&B UI."""
    tracker.image("loss_curve", path)
    train, held_out = [], []
    for arch, file in sorted(histories.items()):
        data = json.loads(Path(file).read_text())
        values = smooth([r["bits_per_byte"] for r in data["history"]])
        train += [(arch, r["tokens"], v) for r, v in zip(data["history"], values)]
        held_out += [(f"{arch} {s}", p["tokens"], p[s]) for p in data["probes"] for s in PROBE_STYLE if s in p]
    x = "training bytes seen"
    tracker.line("loss/train_bits_per_byte", train, x, "bits per byte (25-step mean)", title="training loss")
    tracker.line("loss/held_out_bits_per_byte", held_out, x, "bits per byte", title="held-out loss")
