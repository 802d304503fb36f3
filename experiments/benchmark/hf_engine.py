"""experiment=benchmark with engine=hf: HF transformers' own modeling code, our bridge cache (the run's cache config,
`hybridcache.hf.cache_for`) against HF's own DynamicCache on the same model, prompt and tokens.

Per batch size: prefill a random prompt (timed apart), then time each one-token decode forward (greedy, a
third-party loop holding the cache). The two caches alternate round by round (a busy machine slows both alike); each
reports the median over rounds of its tokens/s; the ratio is bridge / HF. Written to benchmark.json and
throughput.png, the reference stated in both.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.hf.engine import check_hf_settings, hf_plans, load_hf_model

REFERENCE = "HF's own DynamicCache on the same model, prompt and tokens"
SMOKE = {"batch_sizes": [1], "prompt_tokens": 8, "new_tokens": 8, "warmup": 1, "repeats": 3}


@torch.no_grad()
def timed_decode(model, cache, ids: torch.Tensor, steps: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of a prompt `ids` [B, T] and `steps` one-token forwards into `cache`."""
    mask = torch.ones_like(ids)
    start = time.perf_counter()
    logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
    return prefill, time.perf_counter() - start


def run(cfg: DictConfig) -> dict[str, Any]:
    from transformers import DynamicCache

    from experiments.benchmark.plots import throughput_bars
    from experiments.core.common import make_console
    from experiments.core.figure_style import cfg_context
    from experiments.core.run_context import RunContext
    from hybridcache.hf import cache_for

    console = make_console()
    prep = check_hf_settings(cfg, prompts=False)
    b = OmegaConf.merge(cfg.experiment, SMOKE) if cfg.experiment.smoke else cfg.experiment
    ctx = RunContext.create(cfg, title=f"benchmark-{prep['model_type']} (engine=hf)")
    with console.status("[bold]loading with HF transformers[/]"):
        model = load_hf_model(prep, cfg.model.device)
    plan, _ = hf_plans(model, prep["cache_config"])
    text = model.config.get_text_config(decoder=True)
    vocab = int(text.vocab_size)
    console.print(f"model: HF transformers' {type(model).__name__} from the {prep['checkpoint_note']}")
    console.print(f"ours: HF's modeling code with our cache (cache={cfg.cache_name}); reference: {REFERENCE}")
    makers = {
        "ours (hf bridge)": lambda batch: cache_for(model, prep["cache_config"]),
        "hf": lambda batch: DynamicCache(config=text),
    }
    rows = []
    steps = int(b.new_tokens) - 1
    for batch in b.batch_sizes:
        generator = torch.Generator().manual_seed(int(cfg.seed))
        ids = torch.randint(3, max(4, min(vocab, 30000)), (int(batch), int(b.prompt_tokens)), generator=generator)
        ids = ids.to(cfg.model.device)
        for _ in range(int(b.warmup)):
            for make in makers.values():
                timed_decode(model, make(batch), ids, min(2, steps))
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in makers}
        for _ in range(int(b.repeats)):
            for name, make in makers.items():
                times[name].append(timed_decode(model, make(batch), ids, steps))
        for name, pairs in times.items():
            rows.append(
                {
                    "system": name,
                    "batch": int(batch),
                    "prefill_tok_s": statistics.median(batch * ids.shape[1] / p for p, _ in pairs),
                    "decode_tok_s": statistics.median(batch * steps / d for _, d in pairs) if steps else None,
                    "repeats": len(pairs),
                }
            )
    for batch in b.batch_sizes:
        ours, hf = (next(r for r in rows if r["system"] == s and r["batch"] == batch) for s in makers)
        if ours["decode_tok_s"] and hf["decode_tok_s"]:
            ours["decode_ratio_vs_hf"] = ours["decode_tok_s"] / hf["decode_tok_s"]
    plot = throughput_bars(rows, ctx.out_dir / "throughput.png", cfg_context(cfg) + " · engine=hf")
    result = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "engine": {"name": "hf", "ours": f"HF's modeling code with our cache (cache={cfg.cache_name})",
                   "reference": REFERENCE, "model_class": type(model).__name__},
        "checkpoint": prep["checkpoint"],
        "plan": plan.to_records(1, int(b.prompt_tokens) + steps),
        "throughput": rows,
        "plots": [str(plot)],
    }  # fmt: skip
    path = ctx.write(result, "benchmark.json")
    for r in rows:
        ratio = f"   {r['decode_ratio_vs_hf']:.2f}x HF" if "decode_ratio_vs_hf" in r else ""
        decode = "n/a" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
        console.print(
            f"batch {r['batch']}  {r['system']:<17} decode {decode} tokens/s   prefill {r['prefill_tok_s']:.0f} "
            f"tokens/s{ratio}"
        )
    console.print(f"plots: {plot}\nresults: {path}", soft_wrap=True)
    return result
