"""What every figure shares: one colour per strategy (the same in every figure), a title line that says which model,
weights, dtype and machine the numbers come from, byte units, and text labels placed so they never overprint."""

from __future__ import annotations

import os
import platform
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib.transforms import Bbox  # noqa: E402

# Fixed colours for the strategies and systems the experiments name; a strategy's size suffix is dropped first, so
# sliding_256 (study) and sliding(64) (benchmark) share a colour. Unknown names get a stable colour from their hash.
PALETTE = {
    "native": "#1f77b4",
    "full": "#17becf",
    "sliding": "#ff7f0e",
    "chunked": "#2ca02c",
    "snapkv": "#d62728",
    "int8": "#9467bd",
    "int4": "#8c564b",
    "int4_residual": "#843c39",
    "int4_first2_dense": "#d6616b",
    "kivi": "#e377c2",
    "hf_quantized": "#9c9ede",
    "all_local": "#637939",
    "local": "#a55194",
    "sink": "#7b4173",
    "sink_int8": "#3182bd",
    "globals_sink": "#ce6dbd",
    "tova": "#e7ba52",
    "tova_prefill": "#de9ed6",
    "h2o": "#b5cf6b",
    "knorm": "#5254a3",
    "streaming_llm": "#8ca252",
    "observed_attention": "#bd9e39",
    "expected_attention": "#e7969c",
    "pyramidkv": "#6b6ecf",
    "state_bf16": "#7f7f7f",
    "state_fp8": "#bcbd22",
    "state_int8": "#393b79",
    "state_int4": "#ad494a",
    "ablate_state": "#000000",  # the controls (study.yaml) in greys: what a part of the cache is worth
    "ablate_ssm": "#525252",
    "ablate_attention": "#a1a1a1",
    "recurrent": "#b15928",
    "hybrid": "#1f77b4",
    "attention": "#ff7f0e",
    "ours (compiled)": "#1f77b4",
    "ours (eager)": "#aec7e8",
    "ours (eager, int8 weights)": "#9467bd",
    "ours (eager, bfloat16 weights)": "#8c564b",
    "hf": "#ff7f0e",
    "vllm": "#2ca02c",
}
_FALLBACK = ["#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5", "#ff9896", "#393b79", "#637939", "#8c6d31"]


def strategy_key(name: str) -> str:
    """The colour key of a strategy name: lower case, size suffixes dropped until a known name is left
    (sliding_256, sliding(64) -> sliding; sink_4_252 -> sink; kivi2 -> kivi)."""
    key = name.strip().lower()
    key = re.sub(r"\s*\(.*\)$", "", key) if key not in PALETTE else key  # sliding(64), recurrent (mamba2)
    shorter = key
    while shorter not in PALETTE:
        cut = re.sub(r"[_\-\s]?\d+(\.\d+)?$", "", shorter)  # sliding_256, snapkv_50, kivi2
        if cut == shorter or not cut:
            return key  # an unknown name keeps its own (hashed) colour
        shorter = cut
    return shorter


def strategy_color(name: str) -> str:
    """The one colour `name` has in every figure."""
    key = strategy_key(name)
    return PALETTE.get(key) or _FALLBACK[zlib.crc32(key.encode()) % len(_FALLBACK)]


def machine() -> str:
    """CPU model, its cores and the threads torch runs with (a shared machine's cores are not all ours)."""
    import torch

    name = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s)"


def run_context(model: str, random_weights: bool, dtype: str) -> str:
    """The title line every figure carries: model, weights, dtype, machine."""
    weights = "RANDOM weights (only exactness is meaningful)" if random_weights else "trained weights"
    return f"model {model} · {weights} · {dtype} · {machine()}"


def cfg_context(cfg: Any) -> str:
    """run_context from a Hydra config (model.family / checkpoint / dtype)."""
    m = cfg.model
    name = cfg.get("model_name") or (Path(str(m.checkpoint)).name if m.checkpoint else f"tiny {m.family}")
    return run_context(str(name), not m.checkpoint, str(m.get("dtype", "float32")))


def byte_unit(largest: float) -> tuple[float, str]:
    """(divisor, unit) that shows byte counts up to `largest` with at most four digits."""
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(largest) >= 4 * scale:
            return float(scale), unit
    return 1.0, "B"


def _directions(radius: float) -> list[tuple[float, float]]:
    r, d = radius, radius * 0.7
    return [(r, r * 0.3), (-r, r * 0.3), (r, -r * 0.5), (-r, -r * 0.5), (0, r), (0, -r), (d, d), (-d, d), (d, -d)]


def _align(dx: float, dy: float) -> dict[str, str]:
    return {
        "ha": "left" if dx > 0 else "right" if dx < 0 else "center",
        "va": "bottom" if dy > 0 else "top" if dy < 0 else "center",
    }


def _box(x: float, y: float, w: float, h: float, dx: float, dy: float) -> Bbox:
    """The display box of a w x h text whose anchor sits (dx, dy) pixels from (x, y), aligned as _align says."""
    x0 = x + dx - (0 if dx > 0 else w if dx < 0 else w / 2)
    y0 = y + dy - (0 if dy > 0 else h if dy < 0 else h / 2)
    return Bbox.from_bounds(x0, y0, w, h)


def place_labels(
    ax: Any,
    points: Sequence[tuple[float, float]],
    texts: Sequence[str],
    avoid: Sequence[Bbox] = (),
    fontsize: float = 8,
) -> list[Any]:
    """Annotate each point with its text at the nearest offset where the text box stays inside the axes and overlaps
    no other label, no marker and nothing in `avoid` (display boxes); a label pushed away gets a leader line. Call it
    after the layout is final (tight_layout moves the axes, the offsets are in points)."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    ax.set_xlim(ax.get_xlim())  # frozen: the transforms must not move under the placed labels
    ax.set_ylim(ax.get_ylim())
    frame = ax.get_window_extent(renderer)
    px = ax.transData.transform(points) if len(points) else []
    scale = fig.dpi / 72  # points -> display pixels
    pad = 4 * scale
    taken: list[Bbox] = list(avoid)
    markers = [Bbox.from_extents(x - pad, y - pad, x + pad, y + pad) for x, y in px]
    candidates = [(dx, dy) for radius in (5, 12, 20, 30, 42, 56, 72, 90) for dx, dy in _directions(radius)]
    out = []
    for (x, y), (x_px, y_px), text in zip(points, px, texts):
        probe = ax.text(0, 0, text, fontsize=fontsize)
        size = probe.get_window_extent(renderer)
        probe.remove()
        w, h = size.width + 2, size.height + 2
        chosen, best = None, None
        for dx, dy in candidates:
            box = _box(x_px, y_px, w, h, dx * scale, dy * scale)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            clashes = sum(box.overlaps(b) for b in taken) + sum(box.overlaps(b) for b in markers)
            if inside and not clashes:
                chosen = (dx, dy, box)
                break
            score = clashes + (0 if inside else 100)
            if best is None or score < best[0]:
                best = (score, (dx, dy, box))
        dx, dy, box = chosen or best[1]
        far = abs(dx) > 6 or abs(dy) > 6
        arrow = {"arrowstyle": "-", "lw": 0.6, "color": "0.45", "shrinkA": 0, "shrinkB": 3} if far else None
        out.append(
            ax.annotate(
                text,
                (x, y),
                xytext=(dx, dy),
                textcoords="offset points",
                fontsize=fontsize,
                arrowprops=arrow,
                **_align(dx, dy),
            )
        )
        taken.append(box)
    return out
