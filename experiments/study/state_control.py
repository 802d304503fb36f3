"""The control every trained recurrent model reports (issue 40): its held-out bits/byte with its recurrent states
dropped after every byte. A model that loses nothing without them does not use them, and no state-codec result on it
says anything about state codecs.

Held-out windows are read through our model (the exported checkpoint, its native cache: sliding where it was
trained with an attention window), all windows of a split as one batch, one byte per block, so a state codec runs
after every byte:
- `native`: the model's own cache (equal to reading each window in one block; tested);
- `ssm_zeroed`: every SSM / LRU / delta-rule state replaced by zeros after each byte (`state_codec: zero`); the conv
  states and the attention keep what they hold;
- `states_zeroed`: the conv states too (`quantize_conv: true`): nothing recurrent survives a byte.

    python -m experiments.study.state_control CHECKPOINT_DIR [--windows 8] [--length 1024] [--attention-window W]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import hybridcache as hc
from experiments.train.data import windows
from hybridcache.cache.core.registry import get_layer_class

LN2 = math.log(2)
CONTROLS: dict[str, dict[str, Any]] = {
    "native": {},
    "ssm_zeroed": {"recurrent": {"state_codec": "zero"}},
    "states_zeroed": {"recurrent": {"state_codec": "zero", "quantize_conv": True}},
}


def has_recurrent_layers(model: torch.nn.Module) -> bool:
    return any(get_layer_class(n.type).kind == "recurrent" for n in model.native_layers())


@torch.no_grad()
def bits_per_byte_by_byte(
    model: torch.nn.Module, rows: torch.Tensor, config: dict[str, Any], on_byte=None
) -> float:  # rows: [N, L + 1]
    """Mean next-byte NLL in bits of `rows`, fed one byte per block through a cache built with `config`."""
    ids, targets = rows[:, :-1], rows[:, 1:]
    cache = model.make_cache(ids.shape[0], config)
    nll = torch.zeros((), dtype=torch.float64)
    for t in range(ids.shape[1]):
        logits = model(ids[:, t : t + 1], cache)[:, 0].float()  # [N, V]
        nll += F.cross_entropy(logits, targets[:, t], reduction="sum").double()
        if on_byte is not None:
            on_byte()
    return float(nll) / targets.numel() / LN2


def state_controls(
    model: torch.nn.Module,
    splits: dict[str, np.ndarray],
    length: int,
    count: int,
    console: Console | None = None,
    controls: tuple[str, ...] = tuple(CONTROLS),
) -> dict[str, dict[str, float]]:
    """{split: {control: bits/byte}} over the first `count` windows of `length` bytes of each split."""
    rows = {name: torch.from_numpy(windows(tokens, length, count)) for name, tokens in splits.items()}
    total = sum(r.shape[1] - 1 for r in rows.values()) * len(controls)
    out: dict[str, dict[str, float]] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console or Console(),
        transient=True,
    ) as progress:
        task = progress.add_task("states dropped after every byte", total=total)
        for name, r in rows.items():
            out[name] = {}
            for control in controls:
                progress.update(task, description=f"{name}: {control}")
                out[name][control] = bits_per_byte_by_byte(
                    model, r, CONTROLS[control], on_byte=lambda: progress.advance(task)
                )
    return out


def control_table(results: dict[str, dict[str, float]], title: str) -> Table:
    table = Table(title=title)
    table.add_column("split")
    table.add_column("native", justify="right")
    for c in ("ssm_zeroed", "states_zeroed"):
        table.add_column(f"{c.replace('_', ' ')} (cost)", justify="right")
    for split, row in results.items():
        cells = [
            f"{row[c]:.3f} ({row[c] - row['native']:+.3f})" if c in row else "-"
            for c in ("ssm_zeroed", "states_zeroed")
        ]
        table.add_row(split, f"{row['native']:.3f}", *cells)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="an exported checkpoint directory (experiment=train's hf/)")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows per split (default 8)")
    parser.add_argument("--length", type=int, default=1024, help="bytes per window (default 1024)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.windows < 1 or args.length < 2:
        parser.error("--windows must be >= 1 and --length >= 2")
    from experiments.train.data import cached_corpus
    from experiments.train.loop import eval_splits

    torch.set_num_threads(args.threads)
    console = Console()
    model = hc.from_pretrained(args.checkpoint, dtype=torch.float32)
    if not has_recurrent_layers(model):
        parser.error(f"{args.checkpoint} has no recurrent layers: there is no state to drop")
    start = time.perf_counter()
    results = state_controls(model, eval_splits(cached_corpus()), args.length, args.windows, console)
    title = f"{args.checkpoint}: {args.windows} windows of {args.length} bytes ({time.perf_counter() - start:.0f} s)"
    console.print(control_table(results, title))


if __name__ == "__main__":
    main()
