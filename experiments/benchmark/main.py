"""experiment=benchmark: throughput against HF (and vLLM), cache memory against the minimum, long-context scaling.

Throughput: batch 1 and 8, 128-token prompts, 32 new tokens; prefill = a 1-token generation, decode = the other 31
steps timed by themselves (experiments/benchmark/systems.py); medians over repeats after warm-up, repeated while the
spread is too wide, else marked unreliable with no rate or ratio (experiments/benchmark/timing.py). Long context: each
(strategy, length) runs in a fresh process (experiments/long_context/probe.py) so its peak RSS is its own.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from rich.progress import Progress

import hybridcache as hc
from experiments.benchmark.llamacpp import (
    agreement_lines,
    llamacpp_batches,
    llamacpp_precision,
    llamacpp_rates,
    make_runner,
)
from experiments.benchmark.plots import log_benchmark, scaling_lines, throughput_bars
from experiments.benchmark.roofline import BandwidthProbe, roofline_row, weight_read_bytes
from experiments.benchmark.systems import hf_phases, ours_phases
from experiments.benchmark.table import print_tables, summarize, timed_row
from experiments.benchmark.timing import MIN_REPEATS, judge, time_phases
from experiments.core.common import (
    ReferenceFailed,
    UserError,
    cache_config_from_hydra,
    load_model,
    make_console,
    preflight,
)
from experiments.core.figure_style import cfg_context
from experiments.core.run_context import RunContext
from hybridcache.accel.native.kernels import kernel_status
from hybridcache.checkpoints.tiny import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MAX_SPREAD = 0.25  # experiment.max_spread: a relative interquartile spread above this makes a timing unreliable
PROBE_PASSES = 2  # timed read-bandwidth passes after each timing round (~35 ms each over 1 GiB), after one untimed
MAX_REPEATS_FACTOR = 3  # experiment.max_repeats defaults to 3 x repeats (more rounds while a spread is too wide)
SMOKE = {
    "batch_sizes": [1],
    "prompt_tokens": 8,
    "new_tokens": 8,
    "warmup": 1,
    "repeats": 3,  # the fewest that show a spread
    "compile": False,
    "weights": ["int8"],
    "bandwidth_probe_mib": 64,
    "long_context": {"tokens": [64, 128], "decode_tokens": 4, "prefill_chunk_size": 32},
}


def prompt_ids(vocab: int, batch: int, length: int) -> torch.Tensor:
    """The benchmark's prompts at one batch size: [batch, length] random ids, seeded by the batch size (so every
    system, ours, HF and llama.cpp, reads the same ones)."""
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(batch))


def variant_label(weights: str | None, compiled: bool) -> str:
    """'ours (eager)', 'ours (compiled, int8 weights)', ..."""
    return f"ours ({'compiled' if compiled else 'eager'}{f', {weights} weights' if weights else ''})"


def throughput(
    cfg: DictConfig,
    model,
    checkpoint: str,
    cache_config,
    b: DictConfig,
    runner,
    progress,
    llamacpp=None,
    probe: BandwidthProbe | None = None,
) -> tuple[list, dict]:
    """Ours (each weight format of `experiment.weights`, eager and optionally compiled) and HF, per batch size:
    prefill and decode timed apart, the systems taking turns within each round, repeated until stable
    (experiments/benchmark/timing.py) or marked unreliable. Then vLLM or llama.cpp (`llamacpp`: batch 1 and the largest
    other batch size, each precision matching one of our formats; experiments/benchmark/llamacpp.py), each in its
    own process. `probe`: sampled after every round (`BandwidthProbe.round`), under the batch size, so each row's
    roofline divides by the bandwidth of the minutes its own timings ran in."""
    import transformers

    formats = list(dict.fromkeys([cfg.model.get("weights"), *b.get("weights", [])]))  # the model's own first
    task = progress.add_task("loading the HF reference", total=None)
    ref = (
        transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=model.dtype, attn_implementation="eager")
        .to(model.device)
        .eval()
    )
    models = {}
    for fmt in formats:  # all in memory at once, so they can take turns
        progress.update(task, description=f"loading ours with {fmt or cfg.model.dtype} weights")
        models[fmt] = model if fmt == cfg.model.get("weights") else load_model(cfg, checkpoint, weights=fmt)[1]
    rows, memory, tokens = [], {}, {}  # tokens[(format, batch)]: our greedy rows (llama.cpp's agreement)
    new = int(b.new_tokens)
    for batch in b.batch_sizes:
        ids = prompt_ids(model.vocab_size, batch, int(b.prompt_tokens))
        systems, extra = {}, {}
        for fmt, m in models.items():
            # the cache bytes a decode step reads, averaged over the run (after the prompt .. after the last token)
            first, whole = (
                hc.generate(m, ids, max_new_tokens=n, cache_config=cache_config, output_logits=False) for n in (1, new)
            )
            first, last = first.cache, whole.cache
            tokens[fmt, batch] = whole.sequences[:, ids.shape[1] :].tolist()
            memory.setdefault(batch, last.memory_report())
            for compiled in (False, True) if b.compile else (False,):
                label = variant_label(fmt, compiled)
                systems[label] = ours_phases(m, ids, new, cache_config, compiled, int(b.warmup))
                extra[label] = {
                    "weights_bytes": weight_read_bytes(m)["weights"],
                    "weights_format": fmt,
                    "cache_bytes_read": (first.nbytes() + last.nbytes()) // 2,
                }
        systems["hf"] = hf_phases(ref, ids, new, int(b.warmup))
        same = next((e for e in extra.values() if e["weights_format"] is None), None)
        # HF reads the unpacked weights and (about) the cache our unpacked model holds
        extra["hf"] = {
            "weights_bytes": weight_read_bytes(ref)["weights"],
            "weights_format": None,
            "cache_bytes_read": same["cache_bytes_read"] if same else None,
        }
        progress.update(task, description=f"batch {batch}: warming up (compiling, when experiment.compile=true)")
        timings = time_phases(
            systems,
            int(b.repeats),
            # smoke: exactly `repeats` rounds (it is there so the benchmark cannot rot, not for its numbers)
            int(b.get("max_repeats") or (1 if b.smoke else MAX_REPEATS_FACTOR) * int(b.repeats)),
            float(b.get("max_spread") or MAX_SPREAD),
            on_round=lambda i, label, batch=batch: progress.update(
                task, description=f"batch {batch}: {label} (round {i})"
            ),
            after_round=None if probe is None else partial(probe.round, batch, PROBE_PASSES),
        )
        for label, t in timings.items():
            rows.append({**timed_row(label, batch, b.prompt_tokens, new, t["prefill"], t["decode"]), **extra[label]})
    ref = models = None  # free the HF copy and the variants before a vLLM engine starts
    if runner is not None:
        progress.update(task, description="vLLM (its own engine; start reported apart)")
        rows += vllm_rates(runner, b, model.vocab_size, float(b.get("max_spread") or MAX_SPREAD))
    if llamacpp is not None:
        progress.update(task, description="llama.cpp (its own process; requantizing the GGUF once per precision)")
        dtype = str(model.dtype).removeprefix("torch.")
        precisions = {fmt: llamacpp_precision(fmt, dtype) for fmt in formats}
        # ours' prompts at batch 1 and at the largest other batch size (llama.cpp decodes that many sequences at once)
        prompts = {n: prompt_ids(model.vocab_size, n, int(b.prompt_tokens)).tolist() for n in llamacpp_batches(b)}
        spread = float(b.get("max_spread") or MAX_SPREAD)
        rows += llamacpp_rates(llamacpp, b, prompts, precisions, tokens, torch.get_num_threads(), spread)
    return rows, memory


def vllm_runner(checkpoint: str, cfg: DictConfig):
    """The vLLM runner, built before any work: its preflight refuses what vLLM cannot run here in one line."""
    from hybridcache.reference import VLLMRunner

    return VLLMRunner(
        cfg.reference.python,
        checkpoint,
        cfg.model.dtype,
        int(cfg.reference.max_model_len),
        None,
        float(cfg.reference.timeout),
        OmegaConf.to_container(cfg.reference.engine_args),
    )


def vllm_rates(runner, b: DictConfig, vocab: int, max_spread: float) -> list[dict]:
    """vLLM prefill and decode tokens/s per batch size, all in one engine whose start is reported apart. The worker
    times each phase on its own (to every request's first token, then to the last) in at least MIN_REPEATS runs;
    each phase is judged like ours (median, spread, unreliable with a reason)."""
    batches = [prompt_ids(vocab, batch, int(b.prompt_tokens)).tolist() for batch in b.batch_sizes]
    from hybridcache.reference import ReferenceAnswerError

    rows = []
    try:
        timings = runner.time_batches(batches, int(b.new_tokens), max(int(b.repeats), MIN_REPEATS))
    except (RuntimeError, TimeoutError, ReferenceAnswerError) as e:  # the engine's own failure: status 3, one line
        raise ReferenceFailed(f"the vllm reference failed: {e}") from None
    for t in timings:
        prefill, decode = judge(t["prefill_samples"], max_spread), judge(t["decode_samples"], max_spread)
        row = timed_row("vllm", t["batch"], b.prompt_tokens, int(b.new_tokens), prefill, decode)
        rows.append({**row, "engine_start_s": runner.engine_seconds})
    return rows


def roofline(model, rows: list[dict], probe: BandwidthProbe) -> dict:
    """Adds roofline tok/s and the fraction reached to every row of ours/HF: each row's own weight bytes (packed
    formats read fewer) plus the cache bytes its decode steps read, over the bandwidth sampled between the timing
    rounds of its batch size (all samples where that batch has none)."""
    if probe.median() is None:  # no round ran (nothing timed): a few passes now, so the roofline still has one
        probe.round(None, 5)
    bandwidth = probe.median()
    for r in rows:
        if r.get("cache_bytes_read") is None or r.get("weights_bytes") is None:
            continue
        own = probe.median(r["batch"]) or bandwidth
        # an unreliable decode timing (None) still gets its roofline, but no fraction of it
        row = roofline_row(
            r["system"], r["batch"], r["decode_tok_s"] or 0.0, r["weights_bytes"], r["cache_bytes_read"], own
        )
        r.update(
            bytes_per_token=row["bytes_per_token"],
            roofline_tok_s=row["roofline_tok_s"],
            roofline_fraction=row["fraction"] if r["decode_tok_s"] is not None else None,
        )
    rates = [r for rs in probe.samples.values() for r in rs]
    return {
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "read_bandwidth_range_gb_s": [min(rates) / 1e9, max(rates) / 1e9],
        "read_bandwidth_by_batch_gb_s": {str(k): probe.median(k) / 1e9 for k in probe.samples if k is not None},
        "probe_passes": len(rates),
        "probe_mib": probe.nbytes >> 20,
        **weight_read_bytes(model),
        "dtype": str(model.dtype).removeprefix("torch."),
        "cpu_kernels": kernel_status(),
    }


def long_context(model_cfg: DictConfig, checkpoint: str, b: DictConfig, cfg: DictConfig, progress) -> list[dict]:
    lc = b.long_context
    recurrent = str(tiny_checkpoint(lc.recurrent_model)) if model_cfg.checkpoint is None else None
    strategies = {
        f"sliding({lc.window})": (checkpoint, {"attention": {"type": "sliding", "window": lc.window}}),
        f"chunked({lc.chunk_size})": (checkpoint, {"attention": {"type": "chunked", "chunk_size": lc.chunk_size}}),
        "full": (checkpoint, {"attention": {"type": "full"}}),
    }
    if recurrent:
        strategies[f"recurrent ({lc.recurrent_model})"] = (recurrent, {})
    rows = []
    if not lc.tokens:
        return rows
    task = progress.add_task("long context", total=len(strategies) * len(lc.tokens))
    for name, (ckpt, config) in strategies.items():
        for tokens in lc.tokens:
            progress.update(task, description=f"long context: {name}, {tokens} tokens (own process)")
            cmd = [
                sys.executable,
                "-m",
                "experiments.long_context.probe",
                ckpt,
                json.dumps(config),
                str(tokens),
                str(lc.decode_tokens),
                str(lc.prefill_chunk_size),
            ]
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
            if out.returncode != 0:
                raise RuntimeError(f"long-context probe {name} at {tokens} tokens failed:\n{out.stderr[-2000:]}")
            rows.append({"strategy": name, **json.loads(out.stdout.strip().splitlines()[-1])})
            progress.advance(task)
    return rows


def run(cfg: DictConfig) -> dict[str, Any]:
    if cfg.get("engine", "ours") == "hf":  # HF's modeling code: bridge cache vs DynamicCache
        from experiments.benchmark.hf_engine import run as run_hf

        return run_hf(cfg)
    console = make_console()
    preflight(cfg, with_prompts=False)  # settings, device and cache fields checked before any model is loaded
    ctx = RunContext.create(cfg, title=f"benchmark-{cfg.get('model_name') or cfg.model.family}")
    out_dir = ctx.out_dir
    b = cfg.experiment
    if b.smoke:
        b = OmegaConf.merge(b, SMOKE)
    with console.status(f"[bold]loading {cfg.model.family}[/]"):
        checkpoint, model = load_model(cfg)
    runner = llamacpp = None
    if cfg.reference.name == "vllm":
        try:  # refusals (family, dtype, head size) and a missing interpreter: one line, before any timing
            runner = vllm_runner(checkpoint, cfg)
        except (ValueError, FileNotFoundError) as e:
            raise UserError(f"reference=vllm: {e}") from None
    elif cfg.reference.name == "llamacpp":  # absent (or another model): skipped, one line saying why
        llamacpp = make_runner(cfg, checkpoint, lambda line: console.print(f"[yellow]{line}[/]", soft_wrap=True))
    cache_config, _ = cache_config_from_hydra(cfg.cache)
    ops, ops_cfg = None, (OmegaConf.to_container(b.cache_ops) if "cache_ops" in b else {})
    with Progress(console=console, transient=True) as progress:
        compile_start = time.perf_counter()
        task = progress.add_task("starting the read-bandwidth probe (its own process)", total=None)
        # sampled between the timing rounds; its buffer lives in its worker, so it is not in this peak RSS
        with BandwidthProbe(int(b.get("bandwidth_probe_mib", 1024)) << 20) as probe:
            progress.remove_task(task)
            rows, memory = throughput(cfg, model, checkpoint, cache_config, b, runner, progress, llamacpp, probe)
            roof = roofline(model, rows, probe)
        scaling = long_context(cfg.model, checkpoint, b, cfg, progress)
        seconds = time.perf_counter() - compile_start
        if ops_cfg.pop("enabled", True):  # speculative decoding, prefix reuse (experiments/benchmark/cache_ops.py)
            from experiments.benchmark.cache_ops import print_cache_ops, run_cache_ops

            progress.add_task("cache operations: speculative decoding, then prefix reuse", total=None)
            ops = run_cache_ops(model, cache_config, ops_cfg, smoke=bool(b.smoke))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary = summarize(rows, memory, scaling, rss, seconds)
    summary["roofline"] = roof
    summary["wall_s"] = time.perf_counter() - compile_start
    if ops:
        summary.update(ops["summary"])
    plots = [throughput_bars(rows, out_dir / "throughput.png", cfg_context(cfg))]
    if scaling:
        plots.append(scaling_lines(scaling, out_dir / "long_context.png", cfg_context(cfg)))
    result = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "checkpoint": checkpoint,
        "throughput": rows,
        "memory": {str(k): v for k, v in memory.items()},
        "long_context": scaling,
        "summary": summary,
        "plots": [str(p) for p in plots],
        "cache_ops": ops,
    }
    json_path = ctx.write(result, "benchmark.json")  # first: W&B must never cost the results
    tracker = ctx.start_tracker(tags=["benchmark", cfg.model.family], config=result["config"])
    tracker.table("throughput", list(rows[0]), [[r.get(c) for c in rows[0]] for r in rows])
    if scaling:
        tracker.table("long_context", list(scaling[0]), [list(r.values()) for r in scaling])
    tracker.summary(summary)
    log_benchmark(tracker, rows, scaling, plots)  # images and native W&B plots
    run_dir, sync = tracker.run_dir, tracker.sync_command
    tracker.finish()
    result["wandb_dir"] = str(run_dir) if run_dir else None
    result["wandb_error"] = tracker.error
    ctx.write(result, "benchmark.json")
    print_tables(console, rows, memory, scaling, summary)
    for line in agreement_lines(rows):
        console.print(line, soft_wrap=True)
    if ops:
        print_cache_ops(console, ops)
    console.print(
        f"benchmark time: {summary['wall_s']:.0f} s after loading (throughput, roofline and long context "
        f"{summary['throughput_wall_s']:.0f} s)"
    )
    wandb_line = (
        f"W&B run (offline): {run_dir}   upload: {sync}" if sync else f"W&B: {run_dir or tracker.error or 'disabled'}"
    )
    console.print(f"plots: {', '.join(str(p) for p in plots)}\n{wandb_line}\nresults: {json_path}", soft_wrap=True)
    return result
