"""experiment=correctness: our generation under a cache strategy vs a reference, plus the oracle check.

For every prompt: generate with the requested cache strategy; recompute with use_cache=False under the same
strategy (the oracle: a failure is a cache bug); generate with the reference; compare. Results go to the console,
a JSON file in Hydra's output directory and a W&B run (offline by default).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import Progress

import hybridcache as hc
from experiments.common import cache_config_from_hydra, load_model, load_tokenizer, make_reference, tokenize
from experiments.report import print_summary, type_bytes
from hybridcache.cache import resolve_plan
from hybridcache.compare import compare_generations, oracle_check
from hybridcache.reference import Generation, generation_from_logits, write_jsonl
from hybridcache.tracking import Tracker


def _generate_ours(model, prompt, cfg, cache_config, preallocate, eos) -> tuple[Generation, Any, dict]:
    ids = torch.tensor([prompt], device=model.device)
    max_length = len(prompt) + cfg.max_new_tokens if preallocate or cfg.generation.compile else None
    cache = model.make_cache(1, cache_config, max_length)
    start = time.perf_counter()
    out = hc.generate(model, ids, max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, cache=cache,
                      prefill_chunk_size=cfg.prefill_chunk_size, compile=cfg.generation.compile)
    seconds = time.perf_counter() - start
    oracle = hc.generate(model, ids, max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, use_cache=False,
                         cache_config=cache_config)
    check = oracle_check(out.sequences, out.logits, oracle.sequences, oracle.logits, cfg.oracle_tolerance)
    tokens = out.sequences[0, len(prompt):].tolist()
    return generation_from_logits(prompt, tokens, out.logits[0], cfg.top_k, seconds), check, {
        "held": out.cache.nbytes(), "by_type": {r["type"]: r["held"] for r in out.cache.memory_report()}}


def run(cfg: DictConfig) -> dict[str, Any]:
    console = Console(width=max(Console().width, 110))
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    torch.manual_seed(cfg.seed)
    with console.status(f"[bold]loading {cfg.model.family}[/] (a tiny default is built once and reused)"):
        checkpoint, model = load_model(cfg)
        tokenizer = load_tokenizer(checkpoint)
    cache_config, preallocate = cache_config_from_hydra(cfg.cache)
    prompts = tokenize(tokenizer, list(cfg.prompts.texts), model.vocab_size)
    longest = max(len(p) for p in prompts) + cfg.max_new_tokens
    plan = resolve_plan(model.native_layers(), cache_config, longest if preallocate else None)
    native_plan = resolve_plan(model.native_layers())
    console.print(plan.table(batch=1, tokens=longest))
    eos = model.config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos

    ours, checks, memory = [], [], []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("ours + oracle", total=len(prompts))
        for prompt in prompts:
            gen, check, mem = _generate_ours(model, prompt, cfg, cache_config, preallocate, eos)
            ours.append(gen), checks.append(check), memory.append(mem)
            progress.advance(task)
        reference = make_reference(cfg.reference, checkpoint, model.dtype, cfg.model.device, eos)
        refs: list[Generation] | None = None
        if reference is not None:
            task = progress.add_task(f"reference ({reference.name})", total=len(prompts))
            refs = reference.generate(prompts, cfg.max_new_tokens, cfg.top_k, progress=lambda: progress.advance(task))
    record = cfg.get("record")
    if record:
        recorded = write_jsonl(record, refs if refs is not None else ours,
                               {"max_new_tokens": cfg.max_new_tokens, "checkpoint": checkpoint,
                                "source": reference.name if reference else "hybridcache"})
        console.print(f"recorded {len(prompts)} generations to {recorded}")

    comparisons = [compare_generations(o, r) for o, r in zip(ours, refs)] if refs is not None else []
    rows = []
    for i, (text, gen, check) in enumerate(zip(cfg.prompts.texts, ours, checks)):
        row = {"prompt": text, "prompt_tokens": len(gen.prompt), "ours_text": tokenizer.decode(gen.tokens),
               "new_tokens": len(gen.tokens), "oracle_pass": check.passed, "oracle_max_dlogit": check.max_abs_dlogit}
        if comparisons:
            row.update(reference_text=tokenizer.decode(refs[i].tokens), **comparisons[i].to_json())
        rows.append(row)
    new_tokens = sum(len(g.tokens) for g in ours)
    summary = {
        "oracle_pass": all(c.passed for c in checks),
        "oracle_max_dlogit": max(c.max_abs_dlogit for c in checks),
        "tokens_per_s/ours": new_tokens / max(sum(g.seconds for g in ours), 1e-9),
        "cache_bytes/held": memory[-1]["held"],
        "cache_bytes/native": native_plan.held_nbytes(1, len(ours[-1].prompt) + len(ours[-1].tokens)),
        **{f"cache_bytes/held/{t}": b for t, b in memory[-1]["by_type"].items()},
        **{f"cache_bytes/native/{t}": b for t, b in type_bytes(native_plan, 1, len(ours[-1].prompt) + len(ours[-1].tokens)).items()},
    }
    if comparisons:
        summary.update({
            "agreement": sum(c.agreement for c in comparisons) / len(comparisons),
            "pass_rate": sum(c.topk_pass for c in comparisons) / len(comparisons),
            "max_abs_dlogprob": max(c.max_abs_dlogprob for c in comparisons),
            "tokens_per_s/reference": sum(len(r.tokens) for r in refs) / max(sum(r.seconds for r in refs), 1e-9),
        })
        if getattr(reference, "engine_seconds", None):
            summary["reference/engine_start_s"] = reference.engine_seconds  # excluded from tokens/s

    config = OmegaConf.to_container(cfg, resolve=True)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    group = cfg.logger.group or (Path(hydra_cfg.sweep.dir).name if multirun else None)
    name = hydra_cfg.job.override_dirname or f"{cfg.model.family}-native"
    tracker = Tracker(cfg.logger.mode, cfg.logger.project, out_dir, config, group=group, name=name,
                      tags=[cfg.model.family, cfg.reference.name])
    tracker.run.config.update({"cache_plan": plan.to_records(1, longest)}, allow_val_change=True)
    columns = list(rows[0])
    tracker.table("prompts", columns, [[r.get(c) for c in columns] for r in rows])
    tracker.table("cache_plan", list(plan.to_records(1, longest)[0]), [list(r.values()) for r in plan.to_records(1, longest)])
    tracker.summary(summary)
    run_dir = tracker.run_dir
    tracker.finish()

    result = {"config": config, "checkpoint": checkpoint, "cache_config": cache_config, "preallocate": preallocate,
              "plan": plan.to_records(1, longest), "prompts": rows, "summary": summary,
              "generations": {"ours": [g.to_json() for g in ours], "reference": [r.to_json() for r in refs or []]},
              "wandb_dir": str(run_dir) if run_dir else None}
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    print_summary(console, cfg, rows, summary, run_dir, json_path)
    return result
