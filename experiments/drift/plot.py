"""The figure of experiment=drift: one column per state codec, KL(reference || variant) against the position after
the prompt on a log scale (top) and top-1 agreement (bottom), both smoothed; a line style per remedy, the controls
(states dropped after every token) in grey in every column."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from experiments.core.figure_style import strategy_color
from experiments.core.results import save_figure
from experiments.drift.measure import DriftRecord, Variant, smooth

KL_FLOOR = 1e-9  # an exact variant (KL 0) sits on the floor instead of vanishing from a log axis
CODEC_COLOURS = {
    "int8": strategy_color("state_int8"),
    "int4": strategy_color("state_int4"),
    "float8_e4m3fn": strategy_color("state_fp8"),
    "float8_e5m2": "#8c6d31",
    "bfloat16": "#17becf",
    "float16": "#e377c2",
}
STYLES = {"none": "-", "sr": "--", "ef": ":", "sr+ef": "-."}


def remedy_label(remedy: str) -> str:
    words = {"none": "nearest", "sr": "stochastic rounding", "ef": "error feedback", "sr+ef": "stochastic + feedback"}
    base, _, residual = remedy.partition(":")
    return words.get(base, base) + (f" (residual {residual})" if residual else "")


def drift_figure(
    record: DriftRecord, variants: list[Variant], width: int, path: Path, title: str, context: str
) -> Path:
    codecs = list(dict.fromkeys(v.codec for v in variants if v.remedy != "control"))
    controls = [v for v in variants if v.remedy == "control"]
    cols = max(1, len(codecs))
    fig, axes = plt.subplots(
        2, cols, figsize=(4.6 * cols + 0.6, 8.2), sharex=True, sharey="row", squeeze=False, layout="constrained"
    )
    n = next(iter(record.kl.values())).shape[0]
    for col, codec in enumerate(codecs or [None]):
        kl_ax, top_ax = axes[0, col], axes[1, col]
        shown = [v for v in variants if v.codec == codec] + controls
        for v in shown:
            kl = record.kl[v.name].mean(1)  # [N] mean over rows
            top = record.top1[v.name].double().mean(1)
            x, kl_s = smooth(kl, width)
            _, top_s = smooth(top, width)
            base = v.remedy.partition(":")[0]
            if v.remedy == "control":
                style = {"color": strategy_color(v.name), "linestyle": "-", "linewidth": 1.2, "alpha": 0.8}
                label = f"{v.name} (control)"
            else:
                cheap_residual = ":" in v.remedy  # the residual held in another codec: a thin pale solid line
                style = {
                    "color": CODEC_COLOURS.get(codec, "#333333"),
                    "linestyle": "-" if cheap_residual else STYLES.get(base, "-"),
                    "linewidth": 1.0 if cheap_residual else 1.6,
                    "alpha": 0.45 if cheap_residual else 1.0,
                }
                label = remedy_label(v.remedy)
            kl_ax.plot(x.numpy(), kl_s.clamp(min=KL_FLOOR).numpy(), label=label, **style)
            top_ax.plot(x.numpy(), (100 * top_s).numpy(), **style)
        kl_ax.set_yscale("log")
        kl_ax.set_title(f"state_codec {codec}" if codec else "controls", fontsize=10)
        kl_ax.grid(True, which="major", alpha=0.3)
        top_ax.grid(True, alpha=0.3)
        top_ax.set_xlabel("position after the prompt (token)")
        top_ax.set_xlim(0, n)
        top_ax.set_ylim(-3, 103)
        handles, labels = kl_ax.get_legend_handles_labels()
        top_ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    axes[0, 0].set_ylabel(f"KL(reference ‖ variant), nats\n(mean over {width} positions)")
    axes[1, 0].set_ylabel(f"top-1 agreement, %\n(mean over {width} positions)")
    fig.suptitle(f"{title}\n{context}", fontsize=9)
    out = save_figure(fig, path, dpi=130)
    plt.close(fig)
    return out


def curves(record: DriftRecord, width: int) -> dict[str, Any]:
    """The smoothed curves as plain data (results JSON): positions and per variant KL and top-1 means."""
    out: dict[str, Any] = {}
    for name, kl in record.kl.items():
        x, kl_s = smooth(kl.mean(1), width)
        _, top_s = smooth(record.top1[name].double().mean(1), width)
        out[name] = {"kl": [float(v) for v in kl_s], "top1": [float(v) for v in top_s]}
    if record.kl:
        out["_positions"] = [float(v) for v in x]
    return out


def raw_curves(record: DriftRecord) -> dict[str, Any]:
    """Per variant, per position, the mean over rows of KL and top-1 (unsmoothed)."""
    return {
        name: {"kl": [float(v) for v in kl.mean(1)], "top1": [float(v) for v in record.top1[name].double().mean(1)]}
        for name, kl in record.kl.items()
    }
