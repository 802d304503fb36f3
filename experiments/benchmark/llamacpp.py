"""reference=llamacpp in the benchmark: llama.cpp (llama-cpp-python, its own interpreter, a subprocess) on the same
GGUF our real Gemma 3 270M is dequantized from, requantized by llama.cpp to the precision of each of our weight formats
(ours float32 / bfloat16-packed / int8-packed / q8_0-packed vs llama.cpp f32 / bf16 / q8_0 / q8_0), batch 1 and the
benchmark's largest other batch size (B sequences decoded together in one llama.cpp context), the benchmark's
threads, prompts and new tokens. Each phase is judged like ours (experiments/timing.judge); greedy tokens are compared
with ours at the same precision. Absent llama.cpp (or another model): skipped with one line saying why.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from experiments.benchmark.table import timed_row
from experiments.benchmark.timing import MIN_REPEATS, judge

REAL_MODEL = "gemma3_270m"


def llamacpp_precision(fmt: str | None, dtype: str) -> str | None:
    """The llama.cpp precision matching one of our weight formats (None: no counterpart). `fmt` None: the model's
    own dtype."""
    if fmt in ("int8", "q8_0"):  # our q8_0 is llama.cpp's block layout; our int8 (one scale per row) the nearest
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


def llamacpp_batches(b: DictConfig) -> list[int]:
    """The batch sizes llama.cpp runs: 1, and the largest other one of `batch_sizes` if there is one."""
    others = [int(n) for n in b.batch_sizes if int(n) > 1]
    return [1, max(others)] if others else [1]


def agreement(ours: list[list[int]] | None, theirs: list[list[int]]) -> dict:
    """How many greedy tokens agree over the rows, and the first new-token position at which any row differs
    (None: all agree)."""
    if ours is None:
        return {"tokens_agree": None, "first_divergence": None}
    if len(ours) != len(theirs):
        raise ValueError(f"token agreement: {len(ours)} rows of ours vs {len(theirs)} of llama.cpp")
    same = compared = 0
    diverge = None
    for mine, other in zip(ours, theirs):
        same += sum(a == b for a, b in zip(mine, other))
        compared += max(len(mine), len(other))
        first = next((i for i, (a, b) in enumerate(zip(mine, other)) if a != b), None)
        if first is None and len(mine) != len(other):
            first = min(len(mine), len(other))
        if first is not None:
            diverge = first if diverge is None else min(diverge, first)
    return {"tokens_agree": same, "tokens_compared": compared, "first_divergence": diverge}


def llamacpp_rates(
    runner, b: DictConfig, prompts: dict, formats: dict, ours_tokens: dict, threads: int, max_spread: float
) -> list[dict]:
    """llama.cpp rows: one per precision matching our formats (`formats`: our format -> precision) and batch size
    (`prompts`: batch -> its rows; 1 and at most one other), each phase judged like ours, with `weights_format`
    (ours at the same precision: the ratio's partner) and the greedy-token agreement with ours
    (`ours_tokens[(format, batch)]`: our rows)."""
    by_precision: dict[str, str | None] = {}
    for fmt, precision in formats.items():
        if precision is not None:
            by_precision.setdefault(precision, fmt)
    if not by_precision:
        return []
    batched = [n for n in prompts if n > 1]
    results = runner.time_generation(
        prompts[1][0],
        int(b.new_tokens),
        threads,
        max(int(b.repeats), MIN_REPEATS),
        by_precision,
        batch_prompts=prompts[batched[0]] if batched else None,
    )
    rows = []
    for res in results:
        fmt = by_precision[res["precision"]]
        runs = [(1, res)] + ([(res["batched"]["batch"], res["batched"])] if res.get("batched") else [])
        for batch, run in runs:
            theirs = [run["tokens"]] if batch == 1 else run["tokens"]
            prefill, decode = judge(run["prefill_samples"], max_spread), judge(run["decode_samples"], max_spread)
            length = len(prompts[batch][0])
            row = timed_row(f"llama.cpp ({res['precision']})", batch, length, int(b.new_tokens), prefill, decode)
            rows.append(
                {
                    **row,
                    "weights_format": fmt,
                    "llamacpp_precision": res["precision"],
                    "llamacpp_version": runner.version,
                    "llamacpp_note": getattr(runner, "note", None),
                    "threads": threads,
                    "prepare_s": res.get("prepare_s"),
                    **agreement(ours_tokens.get((fmt, batch)), theirs),
                }
            )
    return rows


def agreement_lines(rows: list[dict]) -> list[str]:
    """One line per llama.cpp row: its greedy tokens against ours at the same precision."""
    lines = []
    for r in rows:
        if not r["system"].startswith("llama.cpp"):
            continue
        if r.get("llamacpp_note") and r["llamacpp_note"] not in lines:
            lines.append(r["llamacpp_note"])
        ours = f"ours ({r['weights_format'] or 'model dtype'} weights)"
        if r.get("tokens_agree") is None:
            lines.append(f"{r['system']}: no tokens of {ours} to compare")
            continue
        where = "" if r["first_divergence"] is None else f", first difference at new token {r['first_divergence']}"
        lines.append(
            f"{r['system']} batch {r['batch']} vs {ours}: greedy tokens agree "
            f"{r['tokens_agree']}/{r['tokens_compared']}{where}"
            f" (llama-cpp-python {r.get('llamacpp_version')}, {r.get('threads')} threads)"
        )
    return lines
