"""experiment=drift: drift of lossy recurrent states over a long greedy decode, with and without the remedies.

The reference (the app's cache; native unless `cache=` says otherwise) greedy-decodes `decode_tokens` tokens from
`rows` prompts of `prompt_tokens` tokens (`feed: text`: is fed the text that follows each prompt instead, for models
whose greedy text falls into a loop); every variant (`codec[+sr][+ef[:error_codec]]`) and control is fed the
same tokens one per block, so its states are re-encoded after every token (experiments/drift/measure.py). Reports,
per variant, the mean KL(reference || variant) and top-1 agreement in each of `windows` (decoded positions), the
recurrent-state bytes per row, and the seconds its cache took; writes drift.json and drift.png (curves per codec:
KL on a log scale and top-1 agreement, smoothed over `smooth` positions). docs/state_drift.md reads the results.

    python run.py experiment=drift model=trained_hybrid
    python run.py experiment=drift model=trained_hybrid model.checkpoint=/path/to/hf   # another trained checkpoint
    python run.py experiment=drift experiment.smoke=true model=trained_hybrid        # CI: ~64 tokens
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from experiments.core.common import UserError, load_model, load_tokenizer, make_console, native_layers_of, preflight
from experiments.core.figure_style import run_context
from experiments.core.run_context import RunContext
from experiments.drift.measure import (
    Variant,
    VariantError,
    measure_drift,
    parse_variant,
    summarize,
    variant_config,
    windows_of,
)
from experiments.drift.plot import curves, drift_figure, raw_curves
from experiments.study.data import documents

SMOKE = {
    "decode_tokens": 64,
    "prompt_tokens": 16,
    "rows": 1,
    "windows": [[0, 16], [16, 32], [32, 64]],
    "smooth": 8,
    "variants": ["int8", "int8+sr+ef", "int4+ef:bfloat16"],
}


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"experiment.{name} must be a positive integer, got {value!r}")
    return value


def settings(e: DictConfig) -> dict[str, Any]:
    """The experiment's settings, smoke applied, every value checked (UserError) before any work."""
    s = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in e.items()}
    if not isinstance(s.get("smoke"), bool):
        raise UserError(f"experiment.smoke must be true or false, got {s.get('smoke')!r}")
    if s["smoke"]:
        s.update(SMOKE)
    for name in ("decode_tokens", "prompt_tokens", "rows", "smooth"):
        _positive(name, s.get(name))
    if s.get("feed") not in ("greedy", "text"):
        raise UserError(f"experiment.feed must be greedy or text, got {s.get('feed')!r}")
    seed = s.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise UserError(f"experiment.seed must be an integer in [0, 2^63), got {seed!r}")
    windows = s.get("windows")
    if not isinstance(windows, list) or not windows:
        raise UserError(f"experiment.windows must be a list of [start, end) position pairs, got {windows!r}")
    for w in windows:
        if (
            not isinstance(w, list)
            or len(w) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in w)
            or not 0 <= w[0] < w[1]
        ):
            raise UserError(f"experiment.windows: each window is [start, end) with 0 <= start < end, got {w!r}")
    names = list(s.get("variants") or []) + list(s.get("controls") or [])
    if not names:
        raise UserError("experiment.variants and experiment.controls are both empty: nothing to measure")
    if len(set(names)) != len(names):
        raise UserError(f"experiment.variants / controls name a variant twice: {names}")
    try:
        s["parsed"] = [parse_variant(v, seed) for v in names]
    except VariantError as err:
        raise UserError(str(err)) from None
    if any(v.remedy == "control" for v in s["parsed"][: len(s.get("variants") or [])]):
        raise UserError("experiment.variants: list ablate_ssm / ablate_state under experiment.controls")
    if any(v.remedy != "control" for v in s["parsed"][len(s.get("variants") or []) :]):
        raise UserError(f"experiment.controls must be among ablate_ssm, ablate_state, got {s.get('controls')}")
    return s


def check_configs(base: dict[str, Any], variants: list[Variant], checkpoint: str) -> dict[str, dict[str, Any]]:
    """Each variant's cache config resolved against the model's layers (a CacheConfigError is a UserError)."""
    from hybridcache.cache import CacheError, resolve_plan

    _, native = native_layers_of(Path(checkpoint))
    if not any(p.kind == "recurrent" for p in resolve_plan(native, base).layers):
        raise UserError("the model has no recurrent layers: there is no state to drift (pick a hybrid or SSM model)")
    configs = {}
    for v in variants:
        configs[v.name] = variant_config(base, v)
        try:
            resolve_plan(native, configs[v.name])
        except CacheError as err:
            raise UserError(f"experiment.variants: '{v.name}': {err}") from None
    return configs


def state_bytes(model: Any, config: dict[str, Any], tokens: int) -> int:
    """Recurrent-state bytes held per row (codes, scales, residuals) under `config`."""
    plan = model.make_cache(1, config).plan
    return sum(p.spec.held_nbytes(1, tokens) for p in plan.layers if p.kind == "recurrent")


def figure_context(cfg: DictConfig, checkpoint: str) -> str:
    """The figure's title line: the model's name and which checkpoint (its last two path parts), dtype, machine."""
    name = cfg.get("model_name") or cfg.model.family
    where = "/".join(Path(checkpoint).parts[-2:])
    return run_context(f"{name} ({where})", not cfg.model.checkpoint, str(cfg.model.dtype))


def run(cfg: DictConfig) -> dict[str, Any]:
    s = settings(cfg.experiment)
    prepared = preflight(cfg, with_prompts=False)
    configs = check_configs(prepared.cache_config, s["parsed"], prepared.checkpoint)
    console = make_console()
    ctx = RunContext.create(cfg, title=f"drift-{cfg.get('model_name') or cfg.model.family}")
    start = time.perf_counter()
    torch.manual_seed(int(cfg.get("seed", 0)))
    with console.status(f"[bold]loading {cfg.model.family}[/]"):
        checkpoint, model = load_model(cfg)
        tokenizer = load_tokenizer(checkpoint)
    n, length = s["decode_tokens"], s["prompt_tokens"]
    try:  # with feed: text, each document continues past its prompt (n - 1 tokens are fed after it)
        docs = documents(tokenizer, s["text"], length + (n if s["feed"] == "text" else 0), s["rows"], model.vocab_size)
    except ValueError as err:
        raise UserError(f"experiment.text: {err}") from None
    ids = torch.tensor(docs, dtype=torch.long)
    prompts, text = ids[:, :length], (ids[:, length:] if s["feed"] == "text" else None)
    what = "greedy tokens" if text is None else "text tokens (teacher-forced)"
    console.print(
        f"drift: {prepared.checkpoint_note}; {s['rows']} prompt(s) of {length} tokens, {n} {what}, "
        f"{len(configs)} variants fed one token per block"
    )
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"decoding ({len(configs) + 1} caches in lockstep)", total=n)
        record = measure_drift(
            model, prompts, n, configs, prepared.cache_config, lambda p: progress.advance(task), text
        )
    windows = windows_of(s["windows"], n)
    summary = summarize(record, windows)
    tokens = s["prompt_tokens"] + n
    rows = []
    for v in s["parsed"]:
        rows.append(
            {
                "variant": v.name,
                "codec": v.codec,
                "remedy": v.remedy,
                "cache_config": configs[v.name],
                "state_bytes_per_row": state_bytes(model, configs[v.name], tokens),
                "seconds": record.seconds[v.name],
                **summary[v.name],
            }
        )
    reference_bytes = state_bytes(model, dict(prepared.cache_config), tokens)
    wall = time.perf_counter() - start
    table = Table(title=f"drift over {n} {what} (mean over {s['rows']} row(s)); reference: the app's cache")
    table.add_column("variant", justify="left")
    table.add_column("state bytes/row", justify="right")
    for a, b in windows:
        table.add_column(f"KL {a}-{b}", justify="right")
    table.add_column(f"top-1 {windows[-1][0]}-{windows[-1][1]}", justify="right")
    table.add_column("s", justify="right")
    for r in rows:
        table.add_row(
            r["variant"],
            f"{r['state_bytes_per_row']:,}",
            *(f"{w['kl_mean']:.2e}" for w in r["windows"]),
            f"{100 * r['windows'][-1]['top1']:.1f}%",
            f"{r['seconds']:.0f}",
        )
    console.print(table)
    figure = drift_figure(
        record,
        s["parsed"],
        s["smooth"],
        ctx.out_dir / "drift.png",
        f"Drift of re-encoded recurrent states over {n} {what} ({s['rows']} prompt(s) of {length})",
        figure_context(cfg, checkpoint),
    )
    decoded = tokenizer.decode(record.tokens[0].tolist()) if hasattr(tokenizer, "decode") else None
    result = {
        **ctx.base("ok"),
        "checkpoint": checkpoint,
        "settings": {k: v for k, v in s.items() if k != "parsed"},
        "reference_state_bytes_per_row": reference_bytes,
        "reference_seconds": record.seconds["reference"],
        "rows": rows,
        "curves": curves(record, s["smooth"]),
        "per_position": raw_curves(record),
        "tokens_text_row0": decoded,
        "figure": str(figure),
        "wall_s": wall,
    }
    tracker = ctx.start_tracker(tags=["drift", cfg.model.family])
    tracker.table(
        "drift",
        ["variant", "state_bytes_per_row", *(f"kl_{a}_{b}" for a, b in windows), "top1_last_window", "seconds"],
        [
            [r["variant"], r["state_bytes_per_row"], *(w["kl_mean"] for w in r["windows"]), r["windows"][-1]["top1"]]
            + [r["seconds"]]
            for r in rows
        ],
    )
    tracker.summary({"wall_s": wall})
    tracker.finish()
    path = ctx.write(result, "drift.json")
    console.print(f"results: {path}\nfigure: {figure}\nwall time: {wall:.0f} s")
    return result
