"""experiment=benchmark: throughput against HF (and vLLM), cache memory against the minimum, long-context scaling.

Throughput: batch 1 and 8, 128-token prompts, 128 new tokens; prefill time = a 1-token generation, decode
tokens/s = the other 127 steps; medians over repeats after warm-up. Long context: each (strategy, length) runs in
a fresh process (experiments/long_context_probe.py) so its peak RSS is its own.
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import hybridcache as hc
from experiments.common import UserError, cache_config_from_hydra, load_model, make_console, preflight
from experiments.figure_style import cfg_context
from experiments.plots import log_benchmark, scaling_lines, throughput_bars
from experiments.roofline import read_bandwidth, roofline_row, weight_read_bytes
from hybridcache.cache.plan import format_bytes
from hybridcache.ops.cpu_kernels import kernel_status
from hybridcache.tiny_models import tiny_checkpoint
from hybridcache.tracking import Tracker

ROOT = Path(__file__).resolve().parents[1]
SMOKE = {
    "batch_sizes": [1],
    "prompt_tokens": 8,
    "new_tokens": 8,
    "warmup": 1,
    "repeats": 1,
    "compile": False,
    "weights": ["int8"],
    "bandwidth_probe_mib": 64,
    "long_context": {"tokens": [64, 128], "decode_tokens": 4, "prefill_chunk_size": 32},
}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def rates(
    systems: dict[str, Callable[[int], Any]], batch: int, prompt: int, new: int, b: DictConfig, progress=None, task=None
) -> dict[str, dict]:
    """Prefill = a 1-token generation; decode = a `new`-token generation minus the 1-token one, measured as pairs
    back to back (so a slow moment hits both). Every system gets `warmup` short (2-token) generations, then the
    systems take turns, one pair each per repeat, so a slow stretch of the machine hits them all alike; medians
    over `repeats` pairs. `systems`: label -> run(n_new_tokens)."""
    for label, run in systems.items():
        if progress is not None:
            progress.update(task, description=f"batch {batch}: warming up {label}")
        for _ in range(b.warmup):
            run(2)
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in systems}
    for rep in range(b.repeats):
        for label, run in systems.items():
            if progress is not None:
                progress.update(task, description=f"batch {batch}: {label} (repeat {rep + 1}/{b.repeats})")
            start = time.perf_counter()
            run(1)
            middle = time.perf_counter()
            run(new)
            times[label].append((middle - start, time.perf_counter() - middle))
        if progress is not None:
            progress.advance(task)
    out = {}
    for label, pairs in times.items():
        prefill, total = median([p for p, _ in pairs]), median([t for _, t in pairs])
        decode = median([t - p for p, t in pairs])
        # a decode shorter than timer noise (tiny smoke sizes) has no meaningful rate
        out[label] = {
            "system": label,
            "batch": batch,
            "prefill_tok_s": batch * prompt / prefill,
            "decode_tok_s": batch * (new - 1) / decode if decode > 0 else float("nan"),
            "prefill_s": prefill,
            "total_s": total,
        }
    return out


def row_key(system: str) -> str:
    """A summary-key form of a row's system: 'ours (eager, int8 weights)' -> 'ours_eager_int8_weights'."""
    return re.sub(r"[^a-z0-9]+", "_", system.lower()).strip("_")


def variant_label(weights: str | None, compiled: bool) -> str:
    """'ours (eager)', 'ours (compiled, int8 weights)', ..."""
    return f"ours ({'compiled' if compiled else 'eager'}{f', {weights} weights' if weights else ''})"


def throughput(
    cfg: DictConfig, model, checkpoint: str, cache_config, b: DictConfig, runner, progress
) -> tuple[list, dict]:
    """Ours (each weight format of `experiment.weights`, eager and optionally compiled) and HF, per batch size, the
    systems taking turns within each repeat (`rates`)."""
    import transformers

    formats = list(dict.fromkeys([cfg.model.get("weights"), *b.get("weights", [])]))  # the model's own first
    task = progress.add_task("loading the HF reference", total=len(b.batch_sizes) * b.repeats)
    ref = (
        transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=model.dtype, attn_implementation="eager")
        .to(model.device)
        .eval()
    )
    models = {}
    for fmt in formats:  # all in memory at once, so they can take turns
        progress.update(task, description=f"loading ours with {fmt or cfg.model.dtype} weights")
        models[fmt] = model if fmt == cfg.model.get("weights") else load_model(cfg, checkpoint, weights=fmt)[1]
    rows, memory = [], {}
    for batch in b.batch_sizes:
        ids = torch.randint(
            3, model.vocab_size, (batch, b.prompt_tokens), generator=torch.Generator().manual_seed(batch)
        )
        systems, extra = {}, {}
        for fmt, m in models.items():

            def ours(n: int, compile: bool, m=m, ids=ids):
                # tokens only, as HF's generate without output_scores (keeping every step's [B, V] logits costs
                # page faults and copies: 7% of a float32 batch-8 step on a 262k vocabulary)
                return hc.generate(
                    m, ids, max_new_tokens=n, cache_config=cache_config, compile=compile, output_logits=False
                )

            # the cache bytes a decode step reads, averaged over the run (after the prompt .. after the last token)
            first, last = ours(1, False).cache, ours(b.new_tokens, False).cache
            memory.setdefault(batch, last.memory_report())
            for compiled in (False, True) if b.compile else (False,):
                label = variant_label(fmt, compiled)
                if compiled:
                    progress.update(task, description=f"batch {batch}: compiling our decode step ({label})")
                    ours(2, True)  # compile outside the timed region
                systems[label] = lambda n, c=compiled, run=ours: run(n, c)
                extra[label] = {
                    "weights_bytes": weight_read_bytes(m)["weights"],
                    "weights_format": fmt,
                    "cache_bytes_read": (first.nbytes() + last.nbytes()) // 2,
                }

        def hf(n: int, ids=ids):
            with torch.no_grad():
                return ref.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)

        systems["hf"] = hf
        same = next((e for e in extra.values() if e["weights_format"] is None), None)
        # HF reads the unpacked weights and (about) the cache our unpacked model holds
        extra["hf"] = {
            "weights_bytes": weight_read_bytes(ref)["weights"],
            "weights_format": None,
            "cache_bytes_read": same["cache_bytes_read"] if same else None,
        }
        measured = rates(systems, batch, b.prompt_tokens, b.new_tokens, b, progress, task)
        rows += [{**measured[label], **extra[label]} for label in systems]
    ref = models = None  # free the HF copy and the variants before a vLLM engine starts
    if runner is not None:
        progress.update(task, description="vLLM (its own engine; start reported apart)")
        rows += vllm_rates(runner, b, model.vocab_size)
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


def vllm_rates(runner, b: DictConfig, vocab: int) -> list[dict]:
    """vLLM prefill and decode tokens/s per batch size, measured like ours (a 1-token generation, then a full one,
    back to back; decode = the difference), all in one engine whose start is reported apart."""
    batches = [
        torch.randint(3, vocab, (batch, b.prompt_tokens), generator=torch.Generator().manual_seed(batch)).tolist()
        for batch in b.batch_sizes
    ]
    rows = []
    for t in runner.time_batches(batches, int(b.new_tokens), int(b.repeats)):
        decode = t["total_s"] - t["prefill_s"]
        rows.append(
            {
                "system": "vllm",
                "batch": t["batch"],
                "prefill_tok_s": t["batch"] * b.prompt_tokens / t["prefill_s"],
                "decode_tok_s": t["batch"] * (b.new_tokens - 1) / decode if decode > 0 else float("nan"),
                "prefill_s": t["prefill_s"],
                "total_s": t["total_s"],
                "engine_start_s": runner.engine_seconds,
            }
        )
    return rows


def roofline(model, rows: list[dict], b: DictConfig, progress) -> dict:
    """Adds roofline tok/s and the fraction reached to every row of ours/HF: each row's own weight bytes (packed
    formats read fewer) plus the cache bytes its decode steps read."""
    task = progress.add_task("measuring read bandwidth", total=None)
    probe = int(b.get("bandwidth_probe_mib", 1024))
    bandwidth = read_bandwidth(probe << 20)
    progress.remove_task(task)
    for r in rows:
        if r.get("cache_bytes_read") is None or r.get("weights_bytes") is None:
            continue
        row = roofline_row(
            r["system"], r["batch"], r["decode_tok_s"], r["weights_bytes"], r["cache_bytes_read"], bandwidth
        )
        r.update(
            bytes_per_token=row["bytes_per_token"],
            roofline_tok_s=row["roofline_tok_s"],
            roofline_fraction=row["fraction"],
        )
    return {
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "probe_mib": probe,
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
                "experiments.long_context_probe",
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
    console = make_console()
    preflight(cfg, with_prompts=False)  # settings, device and cache fields checked before any model is loaded
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    b = cfg.experiment
    if b.smoke:
        b = OmegaConf.merge(b, SMOKE)
    with console.status(f"[bold]loading {cfg.model.family}[/]"):
        checkpoint, model = load_model(cfg)
    runner = None
    if cfg.reference.name == "vllm":
        try:  # refusals (family, dtype, head size) and a missing interpreter: one line, before any timing
            runner = vllm_runner(checkpoint, cfg)
        except (ValueError, FileNotFoundError) as e:
            raise UserError(f"reference=vllm: {e}") from None
    cache_config, _ = cache_config_from_hydra(cfg.cache)
    ops, ops_cfg = None, (OmegaConf.to_container(b.cache_ops) if "cache_ops" in b else {})
    with Progress(console=console, transient=True) as progress:
        compile_start = time.perf_counter()
        rows, memory = throughput(cfg, model, checkpoint, cache_config, b, runner, progress)
        roof = roofline(model, rows, b, progress)
        scaling = long_context(cfg.model, checkpoint, b, cfg, progress)
        seconds = time.perf_counter() - compile_start
        if ops_cfg.pop("enabled", True):  # speculative decoding, prefix reuse (experiments/benchmark_cache_ops.py)
            from experiments.benchmark_cache_ops import print_cache_ops, run_cache_ops

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
    json_path = out_dir / "benchmark.json"
    json_path.write_text(json.dumps(result, indent=2, default=str))  # first: W&B must never cost the results
    tracker = Tracker(
        cfg.logger.mode,
        cfg.logger.project,
        out_dir,
        result["config"],
        name=f"benchmark-{cfg.get('model_name') or cfg.model.family}",
        tags=["benchmark", cfg.model.family],
    )
    tracker.table("throughput", list(rows[0]), [[r.get(c) for c in rows[0]] for r in rows])
    if scaling:
        tracker.table("long_context", list(scaling[0]), [list(r.values()) for r in scaling])
    tracker.summary(summary)
    log_benchmark(tracker, rows, scaling, plots)  # images and native W&B plots
    run_dir, sync = tracker.run_dir, tracker.sync_command
    tracker.finish()
    result["wandb_dir"] = str(run_dir) if run_dir else None
    result["wandb_error"] = tracker.error
    json_path.write_text(json.dumps(result, indent=2, default=str))
    print_tables(console, rows, memory, scaling, summary)
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


def summarize(rows, memory, scaling, rss_mib, seconds) -> dict[str, Any]:
    out: dict[str, Any] = {"peak_rss_mib": rss_mib, "throughput_wall_s": seconds}
    hf = {r["batch"]: r for r in rows if r["system"] == "hf"}
    for r in rows:
        key = row_key(r["system"])
        out[f"decode_tok_s/{key}/b{r['batch']}"] = r["decode_tok_s"]
        if r.get("engine_start_s") is not None:
            out[f"engine_start_s/{key}/b{r['batch']}"] = r["engine_start_s"]  # excluded from its tokens/s
        if r["system"].startswith("ours") and r["batch"] in hf:
            out[f"decode_speedup_vs_hf/{key}/b{r['batch']}"] = r["decode_tok_s"] / hf[r["batch"]]["decode_tok_s"]
            out[f"prefill_speedup_vs_hf/{key}/b{r['batch']}"] = r["prefill_tok_s"] / hf[r["batch"]]["prefill_tok_s"]
        if r.get("roofline_fraction") is not None:
            out[f"roofline_fraction/{key}/b{r['batch']}"] = r["roofline_fraction"]
    for batch, report in memory.items():
        for m in report:
            out[f"cache_held_over_min/{m['type']}/b{batch}"] = m["ratio"]
    for strategy in {r["strategy"] for r in scaling}:
        points = sorted((r["tokens"], r["peak_rss_mib"]) for r in scaling if r["strategy"] == strategy)
        out[f"rss_ratio_longest_vs_shortest/{strategy}"] = points[-1][1] / points[0][1]
    return out


def print_tables(console: Console, rows, memory, scaling, summary) -> None:
    t = Table(title="throughput (tokens/s, medians; prefill = a 1-token generation, decode = the other steps)")
    for col in (
        "system",
        "batch",
        "prefill tok/s",
        "prefill vs HF",
        "decode tok/s",
        "decode vs HF",
        "roofline tok/s",
        "of roofline",
    ):
        t.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        key = row_key(r["system"])
        speed = summary.get(f"decode_speedup_vs_hf/{key}/b{r['batch']}")
        pre = summary.get(f"prefill_speedup_vs_hf/{key}/b{r['batch']}")
        limit = r.get("roofline_tok_s")
        label = r["system"] + (f" (engine start {r['engine_start_s']:.0f} s, apart)" if r.get("engine_start_s") else "")
        t.add_row(
            label,
            str(r["batch"]),
            f"{r['prefill_tok_s']:.0f}" if r.get("prefill_tok_s") else "-",
            f"{pre:.2f}x" if pre else "",
            f"{r['decode_tok_s']:.1f}",
            f"{speed:.2f}x" if speed else "",
            f"{limit:.1f}" if limit else "",
            f"{r['roofline_fraction']:.0%}" if limit else "",
        )
    console.print(t)
    roof = summary.get("roofline")
    if roof:
        console.print(
            f"roofline: read bandwidth {roof['read_bandwidth_gb_s']:.1f} GB/s (a streaming read-only sum "
            f"over {roof['probe_mib']} MiB, this run); a decode step reads {format_bytes(roof['weights'])} "
            f"of {roof['dtype']} weights (tied head included, untied input embeddings excluded; packed "
            "formats: their own bytes) + the cache; roofline tok/s = batch x bandwidth / (weights + cache "
            f"bytes). CPU decode kernels: {roof['cpu_kernels']}",
            soft_wrap=True,
        )
    m = Table(title="cache memory after the throughput run (held vs theoretical minimum)")
    for col in ("batch", "type", "held", "minimum", "ratio"):
        m.add_column(col, justify="right")
    for batch, report in memory.items():
        for r in report:
            m.add_row(str(batch), r["type"], format_bytes(r["held"]), format_bytes(r["minimum"]), f"{r['ratio']:.2f}")
    console.print(m)
    s = Table(title="long context (prefill in chunks, then decode)")
    for col in ("strategy", "prompt tokens", "prefill s", "decode ms/token", "peak RSS MiB", "cache held"):
        s.add_column(col, justify="left" if col == "strategy" else "right")
    for r in scaling:
        s.add_row(
            r["strategy"],
            str(r["tokens"]),
            f"{r['prefill_s']:.2f}",
            f"{r['decode_ms_per_token']:.2f}",
            f"{r['peak_rss_mib']:.0f}",
            format_bytes(r["cache_bytes"]),
        )
    if scaling:
        console.print(s)
