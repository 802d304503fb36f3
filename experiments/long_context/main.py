"""experiment=long_context: RULER's synthetic tasks at long prompt lengths (4k, 8k, 16k tokens) and a
needle-in-a-haystack grid (depth x length), for the study's cache strategies (docs/long_context.md).

    python run.py experiment=long_context model=gemma3_270m            # the paper setting (hours; see the YAML)
    python run.py experiment=long_context model=gemma3 experiment.smoke=true   # CI's: tiny lengths, seconds

Every (strategy, prompt length) group runs in a fresh process (experiments/long_context/probe.py --job), so its peak
RSS is its own: each prompt is prefilled in chunks of `experiment.chunk` tokens (bounded memory; a
compress-after-prefill strategy, kvpress's presses, gets its whole prompt in one block, as in the study), then
answered greedily; the parent decodes and scores each answer with RULER's metric (experiments/long_context/ruler.py).
With
`experiment.reference_scoring` (a checkout of NVIDIA/RULER) every answer is scored again by RULER's own code and the
agreement is recorded. Identical prompts (the same task, length, depth and seed in `ruler` and `niah`) run once.
Results go to long_context.json (rewritten after every group, so a stopped run keeps what it measured), the NIAH
heatmaps to long_context_niah.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import hybridcache.checkpoints.real  # noqa: F401 - registers the ${real:NAME} resolver used by model configs
from experiments.core.common import checkpoint_path, load_tokenizer, native_layers_of
from experiments.core.errors import UserError
from experiments.core.figure_style import cfg_context
from experiments.core.run_context import RunContext
from experiments.long_context.report import niah_heatmaps, print_tables
from experiments.long_context.ruler import TASKS, has_depth, ruler_sample, score
from experiments.long_context.ruler_reference import ruler_scoring
from experiments.study.strategies import CONTROLS, compresses_after_prefill, probed, strategy_configs
from hybridcache.cache import resolve_plan

SMOKE = {  # a tiny random model on ByT5 bytes: RULER's templates alone take ~600 bytes; 4 worker processes
    "chunk": 256,
    "controls": False,
    "only": ["native", "snapkv_50", "state_int8"],  # state_int8: Gemma 3 has no recurrent states, not rerun
    "ruler": {"tasks": ["niah_single_1", "vt"], "lengths": [1800], "depths": [0.5], "trials": 1, "max_new_tokens": 4},
    "niah": {"task": "niah_single_1", "lengths": [1000, 1800], "depths": [0.0, 1.0], "trials": 1, "max_new_tokens": 4},
}


class LongContextSettingError(UserError, ValueError):
    """A bad experiment=long_context setting (a length, depth, chunk or task), named before any work."""


def check_settings(e: DictConfig) -> None:
    def positive_ints(name: str, values) -> None:
        bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
        if bad:
            raise LongContextSettingError(f"experiment.{name} must be positive token counts, got {bad}")

    def depths(name: str, values) -> None:
        bad = [d for d in values if not 0.0 <= float(d) <= 1.0]
        if bad:
            raise LongContextSettingError(f"experiment.{name} must be in [0, 1], got {bad}")

    if int(e.chunk) < 0:
        raise LongContextSettingError(f"experiment.chunk must be >= 0 (0: the whole prompt at once), got {e.chunk}")
    positive_ints("ruler.lengths", list(e.ruler.lengths))
    positive_ints("niah.lengths", list(e.niah.lengths))
    depths("ruler.depths", list(e.ruler.depths))
    depths("niah.depths", list(e.niah.depths))
    unknown = [t for t in e.ruler.tasks if t not in TASKS]
    if unknown:
        raise LongContextSettingError(
            f"experiment.ruler.tasks names unknown tasks {unknown} (known: {', '.join(TASKS)})"
        )
    if e.niah.lengths and (e.niah.task not in TASKS or not has_depth(e.niah.task)):
        needles = [t for t in TASKS if has_depth(t)]
        raise LongContextSettingError(f"experiment.niah.task must be a needle task ({', '.join(needles)})")
    for section in ("ruler", "niah"):
        for key in ("trials", "max_new_tokens"):
            v = e[section].get(key)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise LongContextSettingError(f"experiment.{section}.{key} must be a positive integer, got {v}")


def prompts_of(e: DictConfig, tokenizer) -> tuple[list[dict], list[str]]:
    """Every prompt of the run, tagged with the part(s) it belongs to ('ruler', 'niah'); identical prompts once."""
    wanted = []
    for task in e.ruler.tasks:
        for L in e.ruler.lengths:
            for d in e.ruler.depths if has_depth(task) else [None]:
                wanted += [("ruler", task, int(L), d, t, e.ruler) for t in range(int(e.ruler.trials))]
    for L in e.niah.lengths:
        for d in e.niah.depths:
            wanted += [("niah", e.niah.task, int(L), d, t, e.niah) for t in range(int(e.niah.trials))]
    by_key: dict[tuple, dict] = {}
    skipped = []
    for part, task, L, d, t, section in wanted:
        key = (task, L, None if d is None else float(d), f"{section.seed}-{t}")
        if key in by_key:
            by_key[key]["parts"].append(part)
            continue
        try:
            s = ruler_sample(tokenizer, task, L, key[2], seed=key[3])
        except ValueError as err:
            skipped.append(f"{task} at {L} tokens: {err}")
            continue
        cap = section.get("max_new_tokens")
        by_key[key] = {
            "parts": [part],
            "task": task,
            "length": L,
            "depth": s.depth,
            "seed": key[3],
            "answers": s.answers,
            "ids": s.ids,
            "max_new_tokens": min(s.max_new_tokens, int(cap)) if cap else s.max_new_tokens,
        }
    return list(by_key.values()), skipped


def run_group(job: dict, on_prompt) -> dict:
    """One (strategy, length) group in a fresh process; each prompt's line as it comes (`on_prompt`)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "PYTHONPATH": str(Path(__file__).parents[2])}
    lines: list[dict] = []
    try:
        with subprocess.Popen(
            [sys.executable, "-m", "experiments.long_context.probe", "--job", f.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        ) as child:
            for line in child.stdout:
                if line.startswith("{"):
                    lines.append(json.loads(line))
                    if "tokens" in lines[-1]:
                        on_prompt(lines[-1])
            err = child.stderr.read()
        if child.returncode:
            raise UserError(f"the long-context worker failed ({child.returncode}): {err.strip().splitlines()[-1:]}")
    finally:
        os.unlink(f.name)
    info = {k: v for line in lines if "tokens" not in line for k, v in line.items()}
    return {"answers": [line for line in lines if "tokens" in line], **info}


def run(cfg: DictConfig) -> dict[str, Any]:
    console = Console(width=max(Console().width, 150))
    ctx = RunContext.create(cfg, title=f"long_context-{cfg.model.family}")
    e = OmegaConf.merge(cfg.experiment, SMOKE) if cfg.experiment.smoke else cfg.experiment
    check_settings(e)
    start_time = time.perf_counter()
    checkpoint = checkpoint_path(cfg.model, cfg.home)
    _, native_layers = native_layers_of(Path(checkpoint))
    tokenizer = load_tokenizer(checkpoint)
    oracle = ruler_scoring(e.reference_scoring) if e.get("reference_scoring") else None
    random_weights = not cfg.model.checkpoint
    console.print(
        f"[bold]long_context[/]: {cfg.model.family} from {checkpoint}"
        + (" (RANDOM weights: scores mean nothing)" if random_weights else "")
    )

    configs = strategy_configs(e)
    rows: dict[str, dict] = {}
    plans = {}
    for name, config in configs.items():
        try:
            plans[name] = resolve_plan(native_layers, config)
        except Exception as err:  # noqa: BLE001 - an inapplicable type: the row says why, the run goes on
            rows[name] = {"name": name, "config": config, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    if e.baseline not in plans:
        raise UserError(f"the baseline strategy '{e.baseline}' is not usable: {rows[e.baseline]['error']}")
    # a strategy whose plan is the baseline's (a state codec on a model without recurrent states) is not run
    # again: its row says so; a control of a part the model lacks is dropped, as in the study
    same = [n for n, p in plans.items() if n != e.baseline and not p.changed(plans[e.baseline])]
    for name in same:
        if name not in CONTROLS.values():
            rows[name] = {"name": name, "config": configs[name], "same_plan": True}
    runnable = [n for n in configs if n in plans and n not in same]
    prompts, skipped = prompts_of(e, tokenizer)
    for note in skipped:
        console.print(f"[yellow]skipped {note}[/]")
    vocab = max((max(p["ids"]) for p in prompts), default=0)
    if prompts and vocab >= native_vocab(checkpoint):
        raise UserError(f"the tokenizer produces ids >= the model's vocab_size {native_vocab(checkpoint)}")

    parts = {"ruler": set(probed(e, "ruler", runnable)), "niah": set(probed(e, "niah", runnable))}
    result: dict[str, Any] = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "checkpoint": checkpoint,
        "random_weights": random_weights,
        "reference_scoring": oracle.source if oracle else None,
        "skipped": skipped,
        "strategies": [],
    }
    lengths = sorted({p["length"] for p in prompts})
    jobs = []
    for name in runnable:
        mine = [p for p in prompts if any(name in parts[part] for part in p["parts"])]
        for L in lengths:
            group = [p for p in mine if p["length"] == L]
            if group:
                jobs.append((name, L, group))
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    runs: dict[str, dict] = {n: {"name": n, "config": configs[n], "groups": {}, "trials": []} for n in runnable}
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("prompts (strategy x length)", total=sum(len(g) for *_, g in jobs))
        for name, L, group in jobs:
            progress.update(bar, description=f"{name} at {L} tokens")
            one_block = compresses_after_prefill(plans[name])
            job = {
                "checkpoint": checkpoint,
                "dtype": str(cfg.model.dtype),
                "device": str(cfg.model.device),
                "weights": cfg.model.get("weights"),
                "config": configs[name],
                "chunk": 0 if one_block else int(e.chunk),
                "threads": int(e.threads),
                "prompts": [{"ids": p["ids"], "max_new_tokens": p["max_new_tokens"]} for p in group],
            }
            started = time.perf_counter()
            out = run_group(job, lambda _: progress.advance(bar))
            for p, a in zip(group, out["answers"]):
                text = tokenizer.decode(a["tokens"], skip_special_tokens=True)
                trial = {k: p[k] for k in ("parts", "task", "length", "depth", "seed", "answers", "max_new_tokens")}
                trial.update(prediction=text, score=score(p["task"], text, p["answers"]), seconds=a["seconds"])
                if oracle:
                    trial["reference_score"] = oracle.score(p["task"], text, p["answers"])
                runs[name]["trials"].append(trial)
            runs[name]["groups"][str(L)] = {
                "prompts": len(group),
                "chunk": job["chunk"] or "whole prompt",
                "peak_rss_mib": out.get("peak_rss_mib"),
                "loaded_rss_mib": out.get("loaded_rss_mib"),
                "cache_bytes": max((a["cache_bytes"] for a in out["answers"]), default=None),
                "wall_s": time.perf_counter() - started,
            }
            result["strategies"] = [summarize(runs[n]) for n in runnable] + list(rows.values())
            result["wall_s"] = time.perf_counter() - start_time
            ctx.write(result, "long_context.json")  # after every group: a stopped run keeps what it measured

    result["strategies"] = [summarize(runs[n]) for n in runnable] + list(rows.values())
    result["reference_agreement"] = agreement(result["strategies"]) if oracle else None
    title = f"NIAH ({e.niah.task}): RULER score by needle depth and prompt length\n{cfg_context(cfg)}"
    plot = niah_heatmaps(result["strategies"], ctx.out_dir / "long_context_niah.png", title)
    result["plot"] = str(plot) if plot else None
    result["wall_s"] = time.perf_counter() - start_time
    tracker = ctx.start_tracker(tags=["long_context", cfg.model.family], config=result["config"])
    if plot:
        tracker.image("long_context_niah", plot)
    run_dir = tracker.run_dir
    tracker.finish()
    result["wandb_dir"] = str(run_dir) if run_dir else None
    json_path = ctx.write(result, "long_context.json")
    print_tables(console, result["strategies"], result["reference_agreement"])
    console.print(f"heatmaps: {plot}\nresults: {json_path}\nwall time: {result['wall_s']:.0f} s")
    return result


def native_vocab(checkpoint: str) -> int:
    from hybridcache.models.core.loading import read_config

    config = read_config(Path(checkpoint))
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))


def summarize(run: dict) -> dict:
    """Mean scores per task and length (RULER), per depth and length (NIAH), and over everything."""
    cells: dict[str, dict[str, list[float]]] = {}
    grid: dict[str, dict[str, list[float]]] = {}
    for t in run["trials"]:
        if "ruler" in t["parts"]:
            cells.setdefault(t["task"], {}).setdefault(str(t["length"]), []).append(t["score"])
        if "niah" in t["parts"]:
            grid.setdefault(str(t["depth"]), {}).setdefault(str(t["length"]), []).append(t["score"])
    ruler = [t["score"] for t in run["trials"] if "ruler" in t["parts"]]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return {
        **run,
        "ruler": {task: {L: mean(v) for L, v in by.items()} for task, by in cells.items()},
        "ruler_mean": mean(ruler) if ruler else None,
        "niah": {d: {L: mean(v) for L, v in by.items()} for d, by in grid.items()},
    }


def agreement(rows: list[dict]) -> dict:
    """How often our score equals the reference scoring's, over every answer of the run."""
    trials = [t for r in rows for t in r.get("trials", []) if "reference_score" in t]
    equal = sum(t["score"] == t["reference_score"] for t in trials)
    return {"samples": len(trials), "equal": equal}
