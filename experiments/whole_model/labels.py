"""How the whole-model page and figure write models, byte counts, shares and token counts."""

from __future__ import annotations


def short_name(model_id: str) -> str:
    """ "nvidia/Nemotron-H-8B-Base-8K" -> "Nemotron-H-8B"."""
    return model_id.split("/")[-1].removesuffix("-Instruct").removesuffix("-Base-8K")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def tokens_label(t: int) -> str:
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)
