"""experiment=correctness: our generation under a cache strategy vs a reference, plus the oracle check.

Every setting is checked before the model is loaded (`preflight`). For every prompt: generate with the requested
cache strategy (timed after a warm-up); recompute the logits of the same tokens in one forward with a fresh cache
under the same strategy (the oracle); generate with the reference; compare. results.json is written before W&B is
touched, and W&B (started early, so it also captures the console) can fail without losing anything.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from omegaconf import DictConfig

from experiments.core.common import (
    Prepared,
    ReferenceFailed,
    UserError,
    environment_failure,
    identity,
    load_model,
    make_console,
    make_reference,
    preflight,
    task_overrides,
)
from experiments.core.report import print_summary, type_bytes, verdict
from experiments.core.results import write_text
from experiments.core.run_context import RunContext
from experiments.correctness.table import prompt_row


def _generate_ours(model, prompt, cfg, prep: Prepared, max_new_tokens: int | None = None):
    import hybridcache as hc

    n = max_new_tokens or int(cfg.max_new_tokens)
    ids = torch.tensor([prompt], device=model.device)
    max_length = len(prompt) + n if prep.preallocate or cfg.generation.compile else None
    cache = model.make_cache(1, prep.cache_config, max_length)
    start = time.perf_counter()
    out = hc.generate(
        model,
        ids,
        max_new_tokens=n,
        eos_token_id=prep.eos,
        cache=cache,
        prefill_chunk_size=cfg.prefill_chunk_size,
        compile=cfg.generation.compile,
    )
    if out.sequences.device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


@torch.no_grad()
def _oracle_logits(model, sequence: torch.Tensor, prompt_len: int, cache_config) -> torch.Tensor:
    """The recompute: the whole generated sequence (minus its last token) in one forward with a fresh cache under the
    same strategy, as use_cache=False does at every step; the logits that chose each new token [1, N, V]."""
    logits = model(sequence[:, :-1], model.make_cache(1, cache_config))
    return logits[:, prompt_len - 1 :]


def _run_prompts(model, cfg, prep: Prepared, console) -> tuple[list, list, list, float]:
    from rich.progress import Progress

    from hybridcache.reference import generation_from_logits
    from hybridcache.tools.compare import teacher_forced_check

    warm = time.perf_counter()
    _generate_ours(model, prep.prompts[0], cfg, prep, max_new_tokens=min(2, int(cfg.max_new_tokens)))
    warmup_s = time.perf_counter() - warm
    ours, checks, memory = [], [], []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("ours + oracle", total=len(prep.prompts))
        for prompt in prep.prompts:
            out, seconds = _generate_ours(model, prompt, cfg, prep)
            tokens = out.sequences[0, len(prompt) :].tolist()
            oracle = _oracle_logits(model, out.sequences, len(prompt), prep.cache_config)
            checks.append(teacher_forced_check(out.sequences[:, len(prompt) :], out.logits, oracle, prep.tolerance))
            ours.append(generation_from_logits(prompt, tokens, out.logits[0], cfg.top_k, seconds))
            seen = int(out.cache.seen.max())
            memory.append(
                {
                    "seen": seen,
                    "held": out.cache.nbytes(),
                    "by_type": {r["type"]: r["held"] for r in out.cache.memory_report()},
                }
            )
            progress.advance(task)
    return ours, checks, memory, warmup_s


def _run_reference(reference, prep: Prepared, cfg, console):
    from rich.progress import Progress

    from hybridcache.reference import ReferenceAnswerError

    if reference is None:
        return None
    if hasattr(reference, "warmup"):
        reference.warmup(prep.prompts[0])
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"reference ({reference.name})", total=len(prep.prompts))
        try:
            return reference.generate(
                prep.prompts, cfg.max_new_tokens, cfg.top_k, progress=lambda: progress.advance(task)
            )
        except (RuntimeError, TimeoutError, ReferenceAnswerError) as e:  # its own failure, its root cause first
            raise ReferenceFailed(f"the {reference.name} reference failed: {e}") from None


def _reference_info(reference, cfg) -> dict[str, Any]:
    """What the reference is and how its timing compares with ours."""
    if reference is None:
        return {"name": "none"}
    if reference.name == "file":
        meta = reference.meta
        source = reference.source
        info = {
            "name": "file",
            "source": source,
            "native": source in ("hf", "vllm"),
            "path": str(reference.path),
            "timing": None,
        }
        if source == "hybridcache":
            info["cache"] = meta.get("cache")
            info["plan"] = meta.get("plan")
        return info
    batched = reference.name == "vllm"
    return {
        "name": reference.name,
        "source": reference.name,
        "native": True,
        "timing": "all prompts in one batch" if batched else "batch 1, per prompt, after a warm-up",
    }


def _plan_keys(records: list[dict] | None) -> list[dict] | None:
    return None if records is None else [{k: v for k, v in r.items() if k != "bytes"} for r in records]


def run(cfg: DictConfig) -> dict[str, Any]:
    """Preflight, then (recording its status in results.json at every step): load, plan, our generations with the
    oracle, the reference, the comparison, the summary and verdict, the report. engine=hf: HF's modeling code with
    our cache (experiments/correctness/hf_engine.py)."""
    if cfg.get("engine", "ours") == "hf":
        from experiments.correctness.hf_engine import run as run_hf

        return run_hf(cfg)
    console = make_console()
    ctx = RunContext.create(cfg)  # output directory, title, W&B group, config (experiments/core/run_context.py)
    ctx.write(ctx.base("starting"))  # results.json exists from the first moment: a run that stops leaves its status
    prep = _checked(cfg, ctx)
    tracker = ctx.start_tracker(tags=[cfg.get("model_name") or cfg.model.family, cfg.cache_name, cfg.reference.name])
    result = _announce(cfg, ctx, prep, console, tracker)
    torch.manual_seed(cfg.seed)
    try:
        _measure(cfg, ctx, prep, console, tracker, result)
    except BaseException as e:
        result.update(status="crashed", error=f"{type(e).__name__}: {e}", exit_code=1)
        try:  # what it got to; run_experiment records a user error, a failed reference or an OS refusal over it
            ctx.write(result)
            write_text(ctx.out_dir / "console.log", console.export_text(clear=False))
        except OSError:  # a full disk refuses these too: the error itself matters more
            pass
        tracker.finish()
        raise
    tracker.finish()
    if tracker.error:
        console.print(f"[yellow]W&B: {tracker.error}; nothing is lost: {ctx.results_path}[/]")
        result["wandb"]["error"] = tracker.error
        ctx.write(result)
    return result


def _checked(cfg, ctx) -> Prepared:
    """preflight: a UserError is one line, before any model is loaded (run_experiment records it); anything else is
    recorded as a crash first."""
    try:
        return preflight(cfg)
    except UserError:
        raise
    except BaseException as e:
        try:
            ctx.write({**ctx.base("crashed"), "error": f"{type(e).__name__}: {e}", "exit_code": 1})
        except OSError:  # a full disk: the error itself matters more
            pass
        raise


def _announce(cfg, ctx, prep: Prepared, console, tracker) -> dict[str, Any]:
    """The run's title and model on the console; the result record, written as 'running'."""
    console.rule(f"[bold]{ctx.title}")
    console.print(f"model: {prep.checkpoint_note}, {cfg.model.dtype} on {cfg.model.device}")
    if tracker.error:
        console.print(
            f"[yellow]W&B: {tracker.error}; continuing without W&B (everything goes to {ctx.results_path})[/]"
        )
    result: dict[str, Any] = {
        "status": "running",
        "title": ctx.title,
        "overrides": task_overrides(),
        "config": ctx.config,
        "checkpoint": prep.checkpoint,
        "checkpoint_note": prep.checkpoint_note,
        "random_weights": not cfg.model.checkpoint,
        "weights_fingerprint": prep.fingerprint,
        "cache_config": prep.cache_config,
        "preallocate": prep.preallocate,
        "notes": prep.notes,
    }
    ctx.write(result)
    return result


def _measure(cfg, ctx, prep: Prepared, console, tracker, result: dict) -> None:
    from hybridcache.tools.compare import compare_generations

    with console.status(f"[bold]loading {cfg.get('model_name') or cfg.model.family}[/]"):
        checkpoint, model = load_model(cfg, prep.checkpoint)
    plans = _show_plan(cfg, model, prep, console)
    ours, checks, memory, warmup_s = _run_prompts(model, cfg, prep, console)
    reference = make_reference(
        cfg.reference, checkpoint, model.dtype, cfg.model.device, prep.eos, expect=identity(cfg, prep),
        prompts=prep.prompts,
    )  # fmt: skip
    refs = _run_reference(reference, prep, cfg, console)
    ref_info = _reference_info(reference, cfg)
    plan_records = plans["plan"].to_records(1, memory[plans["longest"]]["seen"])  # the summary's bytes (eos too)
    if ref_info.get("source") == "hybridcache":
        ref_info["same_plan"] = _plan_keys(ref_info.get("plan")) == _plan_keys(plan_records)
    _record(cfg, prep, checkpoint, reference, refs, ours, plan_records, console)

    comparisons = [compare_generations(o, r) for o, r in zip(ours, refs)] if refs is not None else []
    max_new = int(cfg.max_new_tokens)
    rows = [
        prompt_row(
            text,
            gen,
            check,
            prep.tokenizer,
            max_new,
            refs[i] if comparisons else None,
            comparisons[i] if comparisons else None,
        )  # fmt: skip
        for i, (text, gen, check) in enumerate(zip(cfg.prompts.texts, ours, checks))
    ]
    summary = _summary(prep, plans, ours, checks, memory[plans["longest"]], warmup_s)
    if comparisons:
        summary.update(_reference_summary(comparisons, refs, reference, ref_info))
    lines, exit_code = verdict(cfg, plans["plan"], summary, ref_info)
    summary["verdict"] = lines
    result.update(
        status="oracle_failed" if exit_code else "ok",
        exit_code=exit_code,
        plan=plan_records,
        plan_note=plans["note"],
        reference=ref_info,
        prompts=rows,
        summary=summary,
        generations={"ours": [g.to_json() for g in ours], "reference": [r.to_json() for r in refs or []]},
        wandb={"dir": str(tracker.run_dir) if tracker.run_dir else None, "sync": tracker.sync_command},
    )
    ctx.write(result)  # before any W&B logging
    _report(ctx, console, tracker, rows, summary, ref_info, lines, plan_records)


def _show_plan(cfg, model, prep: Prepared, console) -> dict[str, Any]:
    """The cache plan for the longest prompt (and the native one), printed with the note on what the preset
    changed."""
    from hybridcache.cache import resolve_plan
    from hybridcache.tools.report import plan_table

    prompts = prep.prompts
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    max_length = len(prompts[longest]) + int(cfg.max_new_tokens)
    plan = resolve_plan(model.native_layers(), prep.cache_config, max_length if prep.preallocate else None)
    native_plan = resolve_plan(model.native_layers())
    changed = plan.changed(native_plan)
    # what the longest prompt's cache has seen after its last decode step
    console.print(plan_table(plan, batch=1, tokens=max_length - 1, native=native_plan))
    note = _plan_note(cfg, plan, native_plan, changed)
    console.print(note if changed else f"[bold yellow]{note}[/]")
    for n in prep.notes:
        console.print(f"[yellow]note: {n}[/]")
    return {"plan": plan, "native": native_plan, "changed": changed, "note": note, "longest": longest}


def _record(cfg, prep: Prepared, checkpoint, reference, refs, ours, plan_records, console) -> None:
    """record=PATH: the reference's generations (or ours, when the reference is a file or none) as JSONL."""
    from hybridcache.reference import write_jsonl

    record = cfg.get("record")
    if not record:
        return
    meta = {
        **identity(cfg, prep),
        "checkpoint": checkpoint,
        "source": reference.name if reference and reference.name != "file" else "hybridcache",
    }
    if meta["source"] == "hybridcache":
        meta.update(cache=cfg.cache_name, plan=plan_records)
    try:
        recorded = write_jsonl(record, refs if refs is not None and reference.name != "file" else ours, meta)
    except OSError as e:  # a full disk, /dev/full: one line, status 4; the file is whole or absent (write_jsonl)
        raise (environment_failure(e, "record", record) or e) from None
    console.print(f"recorded {len(prep.prompts)} generations ({meta['source']}) to {recorded}")


def _summary(prep: Prepared, plans: dict, ours, checks, mem: dict, warmup_s: float) -> dict[str, Any]:
    """The oracle, our speed and the bytes held for the longest prompt (vs the plan and the native strategy)."""
    plan, native_plan = plans["plan"], plans["native"]
    new_tokens = sum(len(g.tokens) for g in ours)
    return {
        "plan_exact": plan.exact,
        "plan_changed_layers": plans["changed"],
        "plan_changes_nothing": not plans["changed"],
        "oracle_pass": all(c.passed for c in checks),
        "oracle_max_dlogit": max(c.max_abs_dlogit for c in checks),
        "oracle_tolerance": prep.tolerance,
        "tokens_per_s/ours": new_tokens / max(sum(g.seconds for g in ours), 1e-9),
        "warmup_s/ours": warmup_s,
        "cache_bytes/tokens": mem["seen"],
        "cache_bytes/prompt": plans["longest"],
        "cache_bytes/held": mem["held"],
        "cache_bytes/plan": plan.held_nbytes(1, mem["seen"]),
        "cache_bytes/native": native_plan.held_nbytes(1, mem["seen"]),
        **{f"cache_bytes/held/{t}": b for t, b in mem["by_type"].items()},
        **{f"cache_bytes/native/{t}": b for t, b in type_bytes(native_plan, 1, mem["seen"]).items()},
    }


def _reference_summary(comparisons, refs, reference, ref_info: dict) -> dict[str, Any]:
    """Agreement with the reference, and its speed where it is comparable."""
    deltas = [c.max_abs_dlogprob for c in comparisons if c.max_abs_dlogprob is not None]
    out: dict[str, Any] = {
        "agreement": sum(c.agreement for c in comparisons) / len(comparisons),
        "pass_rate": sum(c.topk_pass for c in comparisons) / len(comparisons),
        "max_abs_dlogprob": max(deltas) if deltas else None,
    }
    if ref_info.get("timing"):
        key = "tokens_per_s/reference_batched" if reference.name == "vllm" else "tokens_per_s/reference"
        out[key] = sum(len(r.tokens) for r in refs) / max(sum(r.seconds for r in refs), 1e-9)
    if getattr(reference, "engine_seconds", None):
        out["reference/engine_start_s"] = reference.engine_seconds  # excluded from tokens/s
    return out


def _report(ctx, console, tracker, rows, summary, ref_info, lines, plan_records) -> None:
    """The console summary and its log, then W&B: the prompts and plan tables, the summary, the files."""
    print_summary(console, ctx.title, rows, summary, ref_info, lines, tracker, ctx.results_path)
    write_text(ctx.out_dir / "console.log", console.export_text(clear=False))
    tracker.config({"cache_plan": plan_records})
    columns = list(rows[0])
    tracker.table("prompts", columns, [[r.get(c) for c in columns] for r in rows])
    tracker.table("cache_plan", list(plan_records[0]), [list(r.values()) for r in plan_records])
    tracker.summary({k: v for k, v in summary.items() if not isinstance(v, list)})
    tracker.save(ctx.out_dir / "console.log")
    tracker.save(ctx.results_path)


def _plan_note(cfg, plan, native_plan, changed: list[str]) -> str:
    """Which layers the preset changed, or that it changed none (said plainly: such a run is the native one)."""
    name = cfg.cache_name
    if changed:
        what = ", ".join(
            f"{p.address} ({q.type}→{p.type})" if q.type != p.type else f"{p.address} ({p.type}, new parameters)"
            for p, q in zip(plan.layers, native_plan.layers)
            if p.address in changed
        )
        return f"cache={name} changes {len(changed)} of {len(plan.layers)} cache layers: {what}"
    model = cfg.get("model_name") or cfg.model.family
    natives = sorted({p.native_type for p in native_plan.layers})
    return (
        f"cache={name} changes no layer of {model} (native types: {', '.join(natives)}): this run is the native "
        "strategy"
        + (
            ""
            if name in ("native", "hybrid")
            else "; hybrid_* presets change only natively full attention layers "
            "(cache.attention.type=... changes every attention layer)"
        )
    )
