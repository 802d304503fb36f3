"""Measure per-layer sensitivities, plan caches for a sweep of byte budgets (hybridcache/tools/planner.py), and check
the
allocations by running them, next to every uniform configuration.

Feeding as experiments/study/state_sensitivity.py does (the prompt as one block, then one token per block, teacher
forced), so presses with schedule prefill compress the prompt and recurrent codecs re-encode after every token, as in a
generation. The cost of a (layer, option) is the KL(native || changed) of the next-token distributions, averaged over
the continuation, with only that layer changed; recurrent codecs are exactly `layer_sensitivity`'s measurement.

    python -m experiments.study.budget_planner --model zamba2 --tokens 48 --prompt 32 --out outputs/budget_planner
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from experiments.core.common import make_console
from experiments.study.state_sensitivity import compare_logits, stepwise_logits
from experiments.whole_model.byte_counts import kind_bytes, saving
from hybridcache.tools.planner import NATIVE, Choice, LayerTable, Scenario, build_tables, pareto_front, uniform_choices

ATTENTION_OPTIONS: dict[str, dict[str, Any]] = {
    "sliding8": {"type": "sliding", "window": 8},
    "sliding16": {"type": "sliding", "window": 16},
    "chunked16": {"type": "chunked", "chunk_size": 16},
    "snapkv0.5": {"type": "snapkv", "compression_ratio": 0.5, "schedule": "prefill", "window_size": 8},
    "snapkv0.75": {"type": "snapkv", "compression_ratio": 0.75, "schedule": "prefill", "window_size": 8},
    "int8": {"storage": "int8"},
    "int4": {"storage": "int4"},
    "kivi2": {"storage": "kivi", "nbits": 2, "q_group_size": 8, "residual": 8},  # sized for short tests
}
RECURRENT_OPTIONS: dict[str, dict[str, Any]] = {
    c: {"state_codec": c} for c in ("bfloat16", "float8_e4m3fn", "int8", "int4")
}
DEFAULT_OPTIONS = {"attention": ATTENTION_OPTIONS, "recurrent": RECURRENT_OPTIONS}


def scaled_options(scale: int) -> dict[str, dict[str, dict[str, Any]]]:
    """DEFAULT_OPTIONS with every window, chunk and snapkv observation window `scale` times longer (sliding and
    chunked names follow their new sizes): the defaults are sized for a few dozen tokens."""
    attention = {}
    for name, spec in ATTENTION_OPTIONS.items():
        spec = {k: v * scale if k in ("window", "chunk_size", "window_size") else v for k, v in spec.items()}
        if spec.get("type") in ("sliding", "chunked"):
            name = f"{spec['type']}{spec.get('window') or spec['chunk_size']}"
        attention[name] = spec
    return {"attention": attention, "recurrent": RECURRENT_OPTIONS}


METRICS = ("kl", "nll_increase")
#: Per-layer controls (issue 40): the ablation of the part a layer's options change. A layer whose control costs
#: less than INSENSITIVE_KL is one the model barely uses: cheap options there are no evidence that they are free.
CONTROL = {"recurrent": {"state_codec": "zero"}, "attention": {"type": "sliding", "window": 1}}
INSENSITIVE_KL = 1e-3


def _progress(console: Console | None) -> Progress:
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    return Progress(*columns, console=console, transient=True, disable=console is None)


@torch.no_grad()
def run_config(model: Any, ids: torch.Tensor, prompt_len: int, config: Mapping[str, Any] | None):
    """`stepwise_logits`'s feeding, also giving back the cache: (logits [B, T - prompt_len, V], cache)."""
    ids = ids.to(model.device)
    cache = model.make_cache(ids.shape[0], config)
    out = [model(ids[:, :prompt_len], cache)[:, -1:]]
    for t in range(prompt_len, ids.shape[1] - 1):
        out.append(model(ids[:, t : t + 1], cache))
    return torch.cat(out, dim=1).float(), cache


def measure_costs(
    model: Any,
    ids: torch.Tensor,
    prompt_len: int,
    tables: Sequence[LayerTable],
    metric: str = "kl",
    console: Console | None = None,
) -> tuple[list[LayerTable], list[dict]]:
    """The tables with measured costs (`metric`: kl or nll_increase), and one row per (layer, option)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    ids = ids.to(model.device)
    targets = ids[:, prompt_len:]
    ref = stepwise_logits(model, ids, prompt_len)
    rows, out = [], []
    todo = [(t, o) for t in tables for o in t.options if o.entry]
    with _progress(console) as progress:
        task = progress.add_task("per-layer sensitivity (one layer changed per run)", total=len(todo) + len(tables))
        for t in tables:
            costs = {}
            # the layer's control: what the model loses without this part of the cache (its recurrent state dropped
            # after every block; its attention limited to the token itself), beside every option's cost
            control = compare_logits(
                ref, stepwise_logits(model, ids, prompt_len, {"layers": {t.address: CONTROL[t.kind]}}), targets
            )
            progress.advance(task)
            for o in t.options:
                if not o.entry:  # the native option: the reference itself
                    m = {"kl": 0.0, "nll_increase": 0.0, "max_abs_dlogit": 0.0}
                else:
                    got = stepwise_logits(model, ids, prompt_len, {"layers": {t.address: dict(o.entry)}})
                    m = compare_logits(ref, got, targets)
                    progress.advance(task)
                costs[o.name] = m[metric]
                rows.append(
                    {
                        "layer": t.address,
                        "kind": t.kind,
                        "option": o.name,
                        "bytes": o.nbytes,
                        **m,
                        "control_kl": control["kl"],
                        "insensitive": control["kl"] < INSENSITIVE_KL,  # its costs say nothing about the options
                    }
                )
            out.append(t.with_costs(costs))
    return out, rows


def evaluate(
    model: Any,
    ids: torch.Tensor,
    prompt_len: int,
    tables: Sequence[LayerTable],
    budgets: Sequence[int],
    console: Console | None = None,
) -> list[dict]:
    """Each budget's allocation and every uniform one, run with all layers changed at once: predicted vs measured."""
    front = pareto_front(tables)
    cases: dict[str, tuple[str, int | None, Choice]] = {}
    for b in budgets:
        choice = front.best_within(b)
        cases.setdefault(f"planned <= {b}", ("planned", b, choice))
    for name, choice in uniform_choices(tables).items():
        cases[f"uniform {name}"] = ("uniform", None, choice)
    ids = ids.to(model.device)
    targets = ids[:, prompt_len:]
    ref, _ = run_config(model, ids, prompt_len, None)
    rows = []
    with _progress(console) as progress:
        task = progress.add_task("planned and uniform configs (all layers at once)", total=len(cases))
        for label, (kind, budget, choice) in cases.items():
            logits, cache = run_config(model, ids, prompt_len, choice.config)
            split, held = choice_by_part(choice), kind_bytes(cache.layers, lambda layer: layer.nbytes())
            rows.append(
                {
                    "config": label,
                    "kind": kind,
                    "budget": budget,
                    "bytes": choice.nbytes,
                    "kv_bytes": split["kv"],
                    "state_bytes": split["state"],
                    "saving": saving(choice.nbytes, native_nbytes(tables)),  # on the whole cache
                    "held_after_run": cache.nbytes(),
                    "held_after_run_kv": held["kv"],
                    "held_after_run_state": held["state"],
                    "predicted_cost": choice.cost,
                    **compare_logits(ref, logits, targets),
                    "choice": choice.names,
                }
            )
            progress.advance(task)
    mark_front(rows)
    return rows


def choice_by_part(choice: Choice) -> dict[str, int]:
    """An allocation's bytes as keys/values and recurrent states ({"kv", "state"}), by its layers' kinds."""
    return kind_bytes(zip(choice.tables, choice.options), lambda pair: pair[1].nbytes, kind=lambda pair: pair[0].kind)


def native_nbytes(tables: Sequence[LayerTable]) -> int:
    return sum(t.option(NATIVE).nbytes for t in tables)


def mark_front(rows: list[dict], metric: str = "kl") -> None:
    """`on_front`: no other row has at most its bytes and a lower measured cost."""
    for r in rows:
        r["on_front"] = not any(q is not r and q["bytes"] <= r["bytes"] and q[metric] < r[metric] for q in rows)


def render_table(rows: Sequence[dict], title: str) -> Table:
    table = Table(title=title)
    columns = ("config", "bytes", "KV / states", "saved (whole cache)", "held after run", "predicted KL")
    for c in (*columns, "measured KL", "ΔNLL", "front"):
        table.add_column(c, justify="left" if c == "config" else "right")
    for r in sorted(rows, key=lambda r: (r["bytes"], r["kl"])):
        table.add_row(
            r["config"],
            str(r["bytes"]),
            f"{r['kv_bytes']} / {r['state_bytes']}",
            "-" if r["saving"] is None else f"{r['saving']:.1%}",
            str(r["held_after_run"]),
            f"{r['predicted_cost']:.2e}",
            f"{r['kl']:.2e}",
            f"{r['nll_increase']:+.2e}",
            "*" if r["on_front"] else "",
        )
    return table


def plot(rows: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    uni = [r for r in rows if r["kind"] == "uniform"]
    planned = sorted((r for r in rows if r["kind"] == "planned"), key=lambda r: r["bytes"])
    floor = min([r["kl"] for r in rows if r["kl"] > 0] or [1e-9]) / 3  # native (KL 0) drawn at the floor
    ax.scatter(
        [r["bytes"] / 1024 for r in uni],
        [max(r["kl"], floor) for r in uni],
        marker="x",
        color="grey",
        label="uniform (same option per kind)",
    )
    ax.plot(
        [r["bytes"] / 1024 for r in planned],
        [max(r["kl"], floor) for r in planned],
        "o-",
        color="C0",
        label="planned, measured",
    )
    ax.plot(
        [r["bytes"] / 1024 for r in planned],
        [max(r["predicted_cost"], floor) for r in planned],
        "s--",
        color="C1",
        alpha=0.7,
        label="planned, predicted (sum of per-layer KL)",
    )
    ax.set_yscale("log")
    ax.set_xlabel("cache bytes held (KiB, peak between blocks)")
    ax.set_ylabel(f"KL(native || config), nats per token (native drawn at {floor:.0e})")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def budget_sweep(tables: Sequence[LayerTable], n: int) -> list[int]:
    """n budgets spread evenly from the smallest allocation's bytes to native's."""
    lo = pareto_front(tables).min_nbytes
    hi = native_nbytes(tables)
    return sorted({lo + (hi - lo) * i // max(1, n - 1) for i in range(n)})


def main(argv: Sequence[str] | None = None) -> list[dict]:
    import hybridcache as hc
    from experiments.core.common import load_tokenizer
    from experiments.core.figure_style import run_context
    from experiments.study.data import documents
    from hybridcache.checkpoints.real import REAL_CHECKPOINTS, SHIPPED, real_checkpoint
    from hybridcache.checkpoints.tiny import tiny_checkpoint

    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument(
        "--model",
        default="zamba2",
        help="a tiny_models family, a real checkpoint's name (trained_hybrid) or a checkpoint directory",
    )
    a.add_argument(
        "--text",
        default="random",
        choices=("random", "pydoc", "stdlib", "mqar"),
        help="random ids (random weights) or the study's English text (a trained model)",
    )
    a.add_argument("--scale", type=int, default=1, help="attention windows / chunks x this (defaults: 8-16 tokens)")
    a.add_argument("--tokens", type=int, default=48)
    a.add_argument("--prompt", type=int, default=32)
    a.add_argument("--budgets", type=int, default=8)
    a.add_argument("--metric", default="kl", choices=METRICS)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--out", default="outputs/budget_planner")
    args = a.parse_args(argv)
    console = make_console()
    if Path(args.model).is_dir():
        path = args.model
    elif args.model in {*REAL_CHECKPOINTS, *SHIPPED}:
        path = str(real_checkpoint(args.model))
    else:
        path = str(tiny_checkpoint(args.model))
    model = hc.from_pretrained(path)
    if args.text == "random":
        ids = torch.randint(3, model.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    else:
        ids = torch.tensor(documents(load_tokenizer(path), args.text, args.tokens, 1, model.vocab_size))
    options = scaled_options(args.scale) if args.scale != 1 else DEFAULT_OPTIONS
    tables = build_tables(model.native_layers(), options, Scenario(1, args.prompt, args.tokens - 1))
    for t in tables:
        for name, why in t.skipped.items():
            console.print(f"layer {t.address}: option {name} skipped: {why}")
    tables, sens = measure_costs(model, ids, args.prompt, tables, args.metric, console)
    for layer, kl in sorted({(r["layer"], r["control_kl"]) for r in sens if r["insensitive"]}):
        console.print(
            f"layer {layer}: dropping its cache (the control) costs KL {kl:.2g} < {INSENSITIVE_KL:g}: the model "
            "barely uses it, so its options' low costs say nothing about them"
        )
    rows = evaluate(model, ids, args.prompt, tables, budget_sweep(tables, args.budgets), console)
    steps = args.tokens - args.prompt - 1
    title = f"{Path(args.model).name} ({args.text} text): {args.prompt}-token prompt + {steps} decode steps"
    console.print(render_table(rows, title))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sensitivity.json").write_text(json.dumps(sens, indent=1))
    (out / "pareto.json").write_text(json.dumps(rows, indent=1))
    random_weights = not Path(args.model).is_dir() and args.model not in {*REAL_CHECKPOINTS, *SHIPPED}
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    context = run_context(Path(args.model).name, random_weights, dtype)
    plot(rows, out / "pareto.png", f"Byte-budget planner vs uniform caches\n{title}\n{context}")
    console.print(f"wrote {out}/sensitivity.json, pareto.json, pareto.png")
    return rows


if __name__ == "__main__":
    main()
