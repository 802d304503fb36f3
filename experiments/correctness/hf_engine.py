"""experiment=correctness with engine=hf: HF transformers' own modeling code for any HF causal-LM checkpoint (families
hybridcache does not implement included), run with our cache through the bridge (`hybridcache.hf.cache_for`).

What is compared with what (printed at the start and stored in results.json under "engine"):
- ours: greedy generation of HF's model with the bridge cache under the plan;
- the reference: the same model, the same loop, with HF's own DynamicCache (its native cache);
- the oracle: HF's forward without a cache, the whole sequence recomputed for every token, each attention layer masked
  with its pattern written from the pattern's definition (experiments/correctness/hf_oracle.py): the plan's own
  pattern when the plan is exact (an exact plan must match it: else exit status 1), the native plan's when it is
  lossy (then the difference is the lossy layers' measured effect, not a bug).
A native plan must also give HF's own tokens; a changed plan differs from them by design.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from omegaconf import DictConfig

from experiments.core.common import load_tokenizer, make_console, tokenize
from experiments.core.report import print_summary, verdict
from experiments.core.run_context import RunContext
from experiments.correctness.table import prompt_row
from experiments.hf.engine import check_hf_settings, hf_plans, load_hf_model

ENGINE = {
    "name": "hf",
    "ours": "HF transformers' modeling code with our cache (hybridcache.hf.cache_for)",
    "reference": "the same HF model and loop with HF's own DynamicCache",
    "oracle": (
        "HF's forward without a cache, each attention layer masked with its pattern (the plan's when exact, the "
        "native plan's when lossy)"
    ),
}


@torch.no_grad()
def greedy(model, prompt: list[int], cache, new: int, eos: int | None) -> tuple[list[int], torch.Tensor, float]:
    """Greedy tokens, their logits [N, V] and the seconds it took, one token per forward (a third-party loop)."""
    ids = torch.tensor([prompt], device=model.device)
    mask = torch.ones_like(ids)
    start = time.perf_counter()
    logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
    tokens, steps = [], []
    for _ in range(new):
        steps.append(logits[0].float())
        token = logits.argmax(-1, keepdim=True)
        tokens.append(int(token))
        if eos is not None and tokens[-1] == eos or len(tokens) == new:
            break
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
    return tokens, torch.stack(steps), time.perf_counter() - start


def run(cfg: DictConfig) -> dict[str, Any]:
    from transformers import DynamicCache

    from experiments.correctness.hf_oracle import oracle_logits, patterns_of
    from hybridcache.hf import cache_for
    from hybridcache.reference import generation_from_logits
    from hybridcache.tools.compare import compare_generations, teacher_forced_check
    from hybridcache.tools.report import plan_table

    console = make_console()
    ctx = RunContext.create(cfg)
    ctx.write(ctx.base("starting"))
    prep = check_hf_settings(cfg)
    tracker = ctx.start_tracker(tags=[str(prep["model_type"]), cfg.cache_name, "engine=hf"])
    console.rule(f"[bold]{ctx.title}")
    with console.status("[bold]loading with HF transformers[/]"):
        model = load_hf_model(prep, cfg.model.device)
    console.print(
        f"model: HF transformers' {type(model).__name__} from the {prep['checkpoint_note']}, {cfg.model.dtype} on "
        f"{cfg.model.device}"
    )
    for key in ("ours", "reference", "oracle"):
        console.print(f"{key}: {ENGINE[key]}")
    plan, native_plan = hf_plans(model, prep["cache_config"])
    changed = plan.changed(native_plan)
    text_config = model.config.get_text_config(decoder=True)
    tokenizer = load_tokenizer(prep["checkpoint"])
    prompts = tokenize(tokenizer, prep["texts"], int(text_config.vocab_size))
    new = int(cfg.max_new_tokens)
    eos = getattr(text_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) and eos else (eos if isinstance(eos, int) else None)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    console.print(plan_table(plan, batch=1, tokens=len(prompts[longest]) + new - 1, native=native_plan))
    console.print(
        f"cache={cfg.cache_name} changes {len(changed)} of {len(plan.layers)} cache layers"
        + (f": {', '.join(changed)}" if changed else " (the native plan)")
    )
    for n in prep["notes"]:
        console.print(f"[yellow]note: {n}[/]")

    oracle_plan = plan if plan.exact else native_plan
    patterns = patterns_of(oracle_plan)
    greedy(model, prompts[0], cache_for(model, prep["cache_config"]), min(2, new), eos)  # warm-up (installs)
    ours, refs, checks, held, seen = [], [], [], [], []
    for prompt in prompts:
        cache = cache_for(model, prep["cache_config"])
        tokens, logits, seconds = greedy(model, prompt, cache, new, eos)
        ours.append(generation_from_logits(prompt, tokens, logits, cfg.top_k, seconds))
        held.append(cache.hybrid.nbytes())
        seen.append(len(prompt) + len(tokens) - 1)
        recompute = oracle_logits(model, prompt, tokens, patterns)
        checks.append(teacher_forced_check(torch.tensor([tokens]), logits[None], recompute[None], prep["tolerance"]))
        if cfg.reference.name == "hf":
            r_tokens, r_logits, r_seconds = greedy(model, prompt, DynamicCache(config=text_config), new, eos)
            refs.append(generation_from_logits(prompt, r_tokens, r_logits, cfg.top_k, r_seconds))
    comparisons = [compare_generations(o, r) for o, r in zip(ours, refs)]
    rows = [
        prompt_row(text, gen, check, tokenizer, new, refs[i] if refs else None, comparisons[i] if refs else None)
        for i, (text, gen, check) in enumerate(zip(prep["texts"], ours, checks))
    ]
    summary = {
        "engine": "hf",
        "plan_exact": plan.exact,
        "plan_changed_layers": changed,
        "plan_changes_nothing": not changed,
        "oracle_pass": all(c.passed for c in checks),
        "oracle_max_dlogit": max(c.max_abs_dlogit for c in checks),
        "oracle_tolerance": prep["tolerance"],
        "tokens_per_s/ours": sum(len(g.tokens) for g in ours) / max(sum(g.seconds for g in ours), 1e-9),
        "cache_bytes/tokens": seen[longest],
        "cache_bytes/prompt": longest,
        "cache_bytes/held": held[longest],
        "cache_bytes/native": native_plan.held_nbytes(1, seen[longest]),
    }
    ref_info = {"name": "none"}
    if refs:
        dlps = [c.max_abs_dlogprob for c in comparisons if c.max_abs_dlogprob is not None]
        summary.update(
            {
                "agreement": sum(c.agreement for c in comparisons) / len(comparisons),
                "pass_rate": sum(c.topk_pass for c in comparisons) / len(comparisons),
                "max_abs_dlogprob": max(dlps) if dlps else None,
                "tokens_per_s/reference": sum(len(g.tokens) for g in refs) / max(sum(g.seconds for g in refs), 1e-9),
            }
        )
        ref_info = {"name": "hf", "label": "HF's own DynamicCache (same model and code)", "same_code": True}
    lines, exit_code = verdict(cfg, plan, summary, ref_info)
    summary["verdict"] = lines
    result = {
        **ctx.base("oracle_failed" if exit_code else "ok"),
        "exit_code": exit_code,
        "engine": {**ENGINE, "model_class": type(model).__name__, "model_type": prep["model_type"]},
        "checkpoint": prep["checkpoint"],
        "checkpoint_note": prep["checkpoint_note"],
        "cache_config": prep["cache_config"],
        "notes": prep["notes"],
        "plan": plan.to_records(1, seen[longest]),
        "reference": ref_info,
        "prompts": rows,
        "summary": summary,
        "generations": {"ours": [g.to_json() for g in ours], "reference": [r.to_json() for r in refs]},
        "wandb": {"dir": str(tracker.run_dir) if tracker.run_dir else None, "sync": tracker.sync_command},
    }
    ctx.write(result)
    print_summary(console, ctx.title, rows, summary, ref_info, lines, tracker, ctx.results_path)
    tracker.summary({k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    tracker.finish()
    from experiments.core.results import write_text

    write_text(ctx.out_dir / "console.log", console.export_text(clear=False))
    return result  # run_experiment records its exit_code
