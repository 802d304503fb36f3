"""reference=llamacpp in the benchmark: llama.cpp (llama-cpp-python, its own interpreter, a subprocess) on the same
GGUF our real Gemma 3 270M is dequantized from, requantized by llama.cpp to the precision of each of our weight formats
(ours float32 / bfloat16-packed / int8-packed vs llama.cpp f32 / bf16 / q8_0), batch 1, the benchmark's threads, prompt
and new tokens. Each phase is judged like ours (experiments/timing.judge); greedy tokens are compared with ours at the
same precision. Absent llama.cpp (or another model): skipped with one line saying why.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from experiments.benchmark_table import timed_row
from experiments.timing import MIN_REPEATS, judge

REAL_MODEL = "gemma3_270m"


def llamacpp_precision(fmt: str | None, dtype: str) -> str | None:
    """The llama.cpp precision matching one of our weight formats (None: no counterpart). `fmt` None: the model's
    own dtype."""
    if fmt == "int8":
        return "q8_0"
    kind = fmt or dtype
    return {"float32": "f32", "bfloat16": "bf16"}.get(kind)


def make_runner(cfg: DictConfig, checkpoint: str, say) -> object | None:
    """The llama.cpp runner, or None after saying in one line why it is skipped (another model, no interpreter)."""
    from hybridcache.reference.llamacpp_runner import (
        LlamaCppRunner,
        LlamaCppUnavailable,
        gemma3_270m_gguf,
        llamacpp_python,
    )

    model = cfg.get("model_name")
    if model != REAL_MODEL or cfg.model.get("checkpoint") is None:
        say(f"llama.cpp reference skipped: it runs the real Gemma 3 270M GGUF only (model={REAL_MODEL}), not {model}")
        return None
    try:
        python = llamacpp_python(cfg.reference.get("python"))
    except LlamaCppUnavailable as e:
        say(f"llama.cpp reference skipped: {e}")
        return None
    cache_dir = Path(str(cfg.get("home") or "~/.cache/hybridcache")).expanduser() / "llamacpp"
    try:
        gguf, sha = gemma3_270m_gguf(cache_dir)
    except ImportError as e:
        say(f"llama.cpp reference skipped: the GGUF package is not installed ({e})")
        return None
    return LlamaCppRunner(python, gguf, cache_dir, sha, float(cfg.reference.get("timeout", 1800)), check=False)


def agreement(ours: list[int] | None, theirs: list[int]) -> dict:
    """How many greedy tokens agree, and the first position that differs (None: all agree)."""
    if ours is None:
        return {"tokens_agree": None, "first_divergence": None}
    same = sum(a == b for a, b in zip(ours, theirs))
    diverge = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if diverge is None and len(ours) != len(theirs):
        diverge = min(len(ours), len(theirs))
    return {"tokens_agree": same, "tokens_compared": max(len(ours), len(theirs)), "first_divergence": diverge}


def llamacpp_rates(
    runner, b: DictConfig, prompt: list[int], formats: dict, ours_tokens: dict, threads: int, max_spread: float
) -> list[dict]:
    """llama.cpp rows at batch 1: one per precision matching our formats (`formats`: our format -> precision),
    each phase judged like ours, with `weights_format` (ours at the same precision: the ratio's partner) and the
    greedy-token agreement with ours."""
    by_precision: dict[str, str | None] = {}
    for fmt, precision in formats.items():
        if precision is not None:
            by_precision.setdefault(precision, fmt)
    if not by_precision:
        return []
    results = runner.time_generation(prompt, int(b.new_tokens), threads, max(int(b.repeats), MIN_REPEATS), by_precision)
    rows = []
    for res in results:
        fmt = by_precision[res["precision"]]
        prefill, decode = judge(res["prefill_samples"], max_spread), judge(res["decode_samples"], max_spread)
        row = timed_row(f"llama.cpp ({res['precision']})", 1, len(prompt), int(b.new_tokens), prefill, decode)
        rows.append(
            {
                **row,
                "weights_format": fmt,
                "llamacpp_precision": res["precision"],
                "llamacpp_version": runner.version,
                "threads": threads,
                "prepare_s": res.get("prepare_s"),
                **agreement(ours_tokens.get(fmt), res["tokens"]),
            }
        )
    return rows


def agreement_lines(rows: list[dict]) -> list[str]:
    """One line per llama.cpp row: its greedy tokens against ours at the same precision."""
    lines = []
    for r in rows:
        if not r["system"].startswith("llama.cpp"):
            continue
        ours = f"ours ({r['weights_format'] or 'model dtype'} weights)"
        if r.get("tokens_agree") is None:
            lines.append(f"{r['system']}: no tokens of {ours} to compare")
            continue
        where = "" if r["first_divergence"] is None else f", first difference at new token {r['first_divergence']}"
        lines.append(
            f"{r['system']} vs {ours}: greedy tokens agree {r['tokens_agree']}/{r['tokens_compared']}{where}"
            f" (llama-cpp-python {r.get('llamacpp_version')}, {r.get('threads')} threads)"
        )
    return lines
