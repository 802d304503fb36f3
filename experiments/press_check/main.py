"""experiment=press_check: our lossy caches against their reference implementations, live, on the same model and prompt.

For each method and compression ratio: the prompt (`context` tokens of English text) compressed once at its end on
every attention layer, in our cache (`schedule: prefill`) and in kvpress 0.5.5 in its own environment
(HYBRIDCACHE_KVPRESS_PYTHON); then the teacher-forced NLL of the next `continuation` tokens. Reports the share of
kvpress's kept positions we kept too (every layer and kv head) and both NLLs. Also `storage: hf_quantized` at each of
`hf_quantized` bits against transformers 5.2's QuantizedCache (quanto) in its own environment (HYBRIDCACHE_HFQ_PYTHON):
the same prompt in one block, then the continuation's NLL. And the decoding-time presses (`decoding`: one case per
method, schedule, budget, compression_interval and prompt ratio): ours in `schedule: decoding` / `prefill_decoding`
against kvpress's DecodingPress / PrefillDecodingPress, the continuation fed one token per block (kvpress compresses
while decoding): the positions every layer holds after each compression, the NLL, `decoding_greedy` greedy tokens.
Writes press_check.json and W&B tables.

    python run.py experiment=press_check model=gemma3_270m
"""

from __future__ import annotations

import time
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from experiments.core.common import UserError, load_model, load_tokenizer
from experiments.core.run_context import RunContext
from experiments.study.data import documents
from hybridcache.reference.hf_quantized_runner import HFQuantizedUnavailable, hfq_python, run_hf_quantized_model
from hybridcache.reference.kvpress_runner import KvpressUnavailable, find_kvpress_python
from hybridcache.reference.press_check import (
    KVPRESS_CLASS,
    check_decoding_case,
    check_decoding_press,
    check_press,
    continuation_nll,
)

COLUMNS = [
    "method",
    "ratio / bits",
    "reference",
    "ours NLL",
    "reference NLL",
    "max |ΔNLL| per token",
    "kept agreement",
    "layers",
    "reference s",
]
DECODING_COLUMNS = [
    "method",
    "schedule",
    "budget / interval",
    "reference",
    "ours NLL",
    "reference NLL",
    "max |ΔNLL| per token",
    "kept agreement",
    "compressions",
    "greedy same",
    "reference s",
]


def run(cfg: DictConfig) -> dict[str, Any]:
    e, console = cfg.experiment, Console(width=max(Console().width, 160))
    unknown = [m for m in e.methods if m not in KVPRESS_CLASS]
    if unknown:
        raise UserError(f"experiment.methods: {unknown} have no kvpress press (known: {', '.join(KVPRESS_CLASS)})")
    bits = [int(b) for b in (e.get("hf_quantized") or [])]
    decoding = decoding_cases(e)
    try:  # every reference environment asked for is there before any work
        if e.methods or decoding:
            find_kvpress_python()
        if bits:
            hfq_python()
    except (KvpressUnavailable, HFQuantizedUnavailable) as err:
        raise UserError(str(err)) from None
    ctx = RunContext.create(cfg, title=f"press_check-{cfg.model.family}")
    start = time.perf_counter()
    with console.status(f"[bold]loading {cfg.model.family}[/]"):
        checkpoint, model = load_model(cfg)
        tokenizer = load_tokenizer(checkpoint)
    context, continuation = int(e.context), int(e.continuation)
    doc = documents(tokenizer, e.text, context + continuation, 1, model.vocab_size)[0]
    rows, decoding_rows = [], []
    cases = [(m, float(r)) for m in e.methods for r in e.ratios] + [("hf_quantized", b) for b in bits]
    cases += [("decoding", c) for c in decoding]
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(
            "ours and kvpress (each kvpress run starts its own process: ~20-60 s)", total=len(cases)
        )
        for method, ratio in cases:
            if method == "hf_quantized":
                rows.append(check_hf_quantized(model, checkpoint, doc[:context], doc[context:], int(ratio)))
            elif method == "decoding":
                progress.update(task, description=f"decoding-time: {ratio['method']} ({ratio['schedule']})")
                greedy = int(e.get("decoding_greedy") or 0)
                check = check_decoding_press(model, checkpoint, doc[:context], doc[context:], greedy=greedy, **ratio)
                decoding_rows.append(check.as_dict())
            else:
                rows.append(check_press(model, checkpoint, doc[:context], doc[context:], method, ratio).as_dict())
            progress.advance(task)
    table = Table(title=f"press_check: {cfg.model.family}, {context}-token prompt, NLL of the next {continuation}")
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("method", "reference") else "right")
    records = [
        [
            r["method"],
            r["compression_ratio"],
            r["reference"],
            r["ours_nll"],
            r["reference_nll"],
            r["max_token_nll_diff"],
            r["kept_agreement"],
            r["layers_compared"],
            r["reference_seconds"],
        ]
        for r in rows
    ]
    for rec, r in zip(records, rows):
        shown = [
            rec[0],
            f"{rec[1]:g}",
            rec[2],
            f"{rec[3]:.5f}",
            "failed" if rec[4] is None else f"{rec[4]:.5f}",
            "" if rec[5] is None else f"{rec[5]:.1e}",
            "n/a" if rec[6] is None else f"{100 * rec[6]:.2f}%",
            str(rec[7]),
            f"{rec[8]:.0f}",
        ]
        bad = r["reference_error"] or (r["kept_agreement"] is not None and r["kept_agreement"] < 1)
        table.add_row(*shown, style="red" if bad else None)
    if rows or not decoding_rows:
        console.print(table)
    decoding_records = decoding_table(console, decoding_rows, context, continuation)
    for r in rows + decoding_rows:
        if r["reference_error"]:
            console.print(f"[red]{r['method']}: kvpress failed: {r['reference_error']}[/]")
    result = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "checkpoint": checkpoint,
        "rows": rows,
        "decoding_rows": decoding_rows,
        "wall_s": time.perf_counter() - start,
    }
    tracker = ctx.start_tracker(tags=["press_check", cfg.model.family], config=result["config"])
    tracker.table("press_check", COLUMNS, records)
    if decoding_records:
        tracker.table("press_check_decoding", DECODING_COLUMNS, decoding_records)
    agreements = [r["kept_agreement"] for r in rows + decoding_rows if r["kept_agreement"] is not None]
    tracker.summary(
        {
            "min_kept_agreement": min(agreements) if agreements else None,
            "max_token_nll_diff": max((r["max_token_nll_diff"] or 0.0 for r in rows), default=None),
            "decoding_not_ties": sum(r["not_ties"] for r in decoding_rows) if decoding_rows else None,
        }
    )
    tracker.finish()
    path = ctx.write(result, "press_check.json")
    console.print(f"results: {path}\nwall time: {result['wall_s']:.0f} s")
    return result


def decoding_cases(e) -> list[dict]:
    """experiment.decoding as plain dicts, each checked (a UserError naming the case) before any work."""
    cases = []
    for i, case in enumerate(e.get("decoding") or []):
        c = OmegaConf.to_container(case, resolve=True) if OmegaConf.is_config(case) else dict(case)
        if "mode" in c:  # renamed 2026-11-29: "mode" is only the logger's
            raise UserError(f"experiment.decoding[{i}]: 'mode' was renamed to 'schedule'")
        args = {
            "method": c.get("method"),
            "schedule": c.get("schedule", "decoding"),
            "budget": c.get("budget"),
            "compression_interval": c.get("compression_interval"),
            "compression_ratio": c.get("compression_ratio"),
        }
        try:
            check_decoding_case(*args.values())
        except ValueError as err:
            raise UserError(f"experiment.decoding[{i}]: {err}") from None
        cases.append(args)
    return cases


def decoding_table(console, rows: list[dict], context: int, continuation: int) -> list[list]:
    """Print the decoding-time rows; returns them as W&B records."""
    if not rows:
        return []
    table = Table(
        title=f"decoding-time presses: {context}-token prompt, then {continuation} tokens one per block (NLL)"
    )
    for c in DECODING_COLUMNS:
        left = c in ("method", "schedule", "reference")
        table.add_column(c, justify="left" if left else "right", no_wrap=c in ("method", "schedule"), overflow="fold")
    records = []
    for r in rows:
        ratio = "" if r["compression_ratio"] is None else f"prompt {r['compression_ratio']:g}, "
        rec = [
            r["method"],
            r["schedule"],
            f"{ratio}{r['budget']} / {r['compression_interval']}",
            r["reference"],
            r["ours_nll"],
            r["reference_nll"],
            r["max_token_nll_diff"],
            r["kept_agreement"],
            r["compressions"],
            f"{r['greedy_same']}/{len(r['greedy_reference'])}",
            r["reference_seconds"],
        ]
        records.append(rec)
        ties = f" (from step {r['first_differing_step']}: float ties)" if r["differing"] and not r["not_ties"] else ""
        shown = [
            *rec[:4],
            f"{rec[4]:.5f}",
            "failed" if rec[5] is None else f"{rec[5]:.5f}",
            ("" if rec[6] is None else f"{rec[6]:.1e}") + _before(r),
            f"{100 * rec[7]:.2f}%{ties}",
            str(rec[8]),
            rec[9],
            f"{rec[10]:.0f}",
        ]
        bad = r["reference_error"] or r["not_ties"] or not r["same_steps"]
        table.add_row(*shown, style="red" if bad else None)
    console.print(table)
    return records


def _before(row: dict) -> str:
    """Where the kept sets part: the largest |ΔNLL| before that can act."""
    before = row["max_token_nll_diff_before"]
    if not row["differing"] or before is None:
        return ""
    return f" ({before:.1e} before step {row['first_differing_step'] + 2})"


def check_hf_quantized(model, checkpoint: str, context: list[int], continuation: list[int], nbits: int) -> dict:
    """`storage: hf_quantized` with HF's defaults (axis 0, q_group_size 64, residual 128) vs transformers 5.2."""
    import torch

    ctx, cont = torch.tensor([context]), torch.tensor([continuation])
    config = {
        "attention": {
            "storage": "hf_quantized",
            "nbits": nbits,
            "axis_key": 0,
            "axis_value": 0,
            "q_group_size": 64,
            "residual": 128,
        }
    }
    ours, _ = continuation_nll(model, ctx, cont, config)
    started = time.perf_counter()
    logits = run_hf_quantized_model(checkpoint, ctx, cont, nbits=nbits, q_group_size=64, residual_length=128)
    theirs = torch.nn.functional.cross_entropy(logits.double(), cont[0], reduction="none")
    return {
        "method": "hf_quantized",
        "compression_ratio": nbits,
        "reference": "transformers 5.2 QuantizedCache (quanto)",
        "ours_nll": float(ours.mean()),
        "reference_nll": float(theirs.mean()),
        "max_token_nll_diff": float((ours.double() - theirs).abs().max()),
        "kept_agreement": None,
        "layers_compared": len(model.native_layers()),
        "reference_error": None,
        "reference_seconds": time.perf_counter() - started,
    }
