"""The whole-model figure: per production model and prompt length, one bar of its whole native cache split into
keys/values and recurrent states (conv and SSM / delta-rule apart), each annotated with its size and what a 4x KV
compression, int8 states and both save on the whole cache."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from experiments.whole_model.byte_counts import CONV, SSM, kv_bytes
from experiments.whole_model.labels import gib, short_name, tokens_label

COLORS = {"kv": "#1f77b4", CONV: "#fdae6b", SSM: "#e6550d"}


def plot(result: Mapping[str, Any], path: Path, strategies: Mapping[str, tuple[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.core.results import save_figure

    tokens, rows = result["tokens"], result["rows"]
    names = [m["name"] for m in result["models"]]
    ids = {m["name"]: short_name(m["model_id"]) for m in result["models"]}
    conv_share = max(r["parts"]["native"][CONV] / r["totals"]["native"] for r in rows)
    fig, axes = plt.subplots(1, len(tokens), figsize=(8.2 * len(tokens), 0.55 * len(names) + 2.2), squeeze=False)
    for ax, t in zip(axes[0], tokens):
        at = {r["model"]: r for r in rows if r["tokens"] == t}
        for y, name in enumerate(names):
            r = at[name]
            native, total = r["parts"]["native"], r["totals"]["native"]
            left = 0.0
            for part, value in (("kv", kv_bytes(native)), (CONV, native[CONV]), (SSM, native[SSM])):
                width = 100 * value / total
                ax.barh(y, width, left=left, color=COLORS[part], edgecolor="white", lw=0.5)
                left += width
            ax.text(1.5, y, f"KV {100 * r['kv_share']:.0f}%", va="center", ha="left", fontsize=7.5, color="white")
            s = r["savings"]
            note = (
                f"{gib(total)}   KV ÷4 −{100 * s['kv_div4']:.0f}%   int8 states −{100 * s['state_int8']:.1f}%   "
                f"both −{100 * s['kv_div4+state_int8']:.0f}%"
            )
            ax.text(102, y, note, va="center", ha="left", fontsize=7.5)
        ax.set_yticks(range(len(names)), [ids[n] for n in names], fontsize=8.5)
        ax.invert_yaxis()
        ax.set_xlim(0, 190)
        ax.set_xticks([0, 25, 50, 75, 100])
        ax.set_xlabel("share of the whole native cache (%)", fontsize=8.5)
        ax.set_title(f"{tokens_label(t)} tokens, batch 1", fontsize=10)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.spines["bottom"].set_bounds(0, 100)
    thin = f"conv states (bfloat16; at most {100 * conv_share:.1f}% of a cache: too thin to see)"
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=COLORS["kv"], label="keys / values (bfloat16)"),
        plt.Rectangle((0, 0), 1, 1, color=COLORS[CONV], label=thin),
        plt.Rectangle((0, 0), 1, 1, color=COLORS[SSM], label="SSM / delta-rule states (float32)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8.5, frameon=False)
    fig.suptitle(
        "What a production hybrid's cache holds, and what each saving is worth on the WHOLE cache\n"
        "(published shapes built by our family code on meta; bytes from our Cache's accounting; right of each bar: "
        f"its size, then the whole-cache saving of {strategies['kv_div4'][0]}, int8 states, both)",
        fontsize=9.5,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save_figure(fig, path, dpi=130)
    plt.close(fig)
    return path
