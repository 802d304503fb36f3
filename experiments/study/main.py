"""experiment=study: what a cache strategy costs. Memory held against quality, on the same text, per strategy.

Bytes are the peak a batch-1 cache holds over the context (`CachePlan.held_nbytes`, equal to `cache.nbytes()` after
the run, which study.json keeps as `bytes_after`). A strategy is a named cache-config mapping in
configs/experiment/study.yaml (`strategies:`); a new one (a new cache type, a storage format, a per-layer mix) is one
more YAML entry, no code. For each strategy and context length: cache bytes held (and vs native), teacher-forced
perplexity on long documents read block by block, KL from native's next-token distribution, top-1 and greedy
agreement with native; kvpress's protocol (an L-token prompt in one block, then N teacher-forced tokens), passkey
retrieval, multi-query associative recall (MQAR, experiments/core/mqar.py) and RULER's synthetic tasks (see
experiments/study/evaluate.py, experiments/long_context/ruler.py).

A strategy that compresses after the prefill (`schedule: prefill`, kvpress's presses) would compress only the first
block of the blockwise read, so it gets no blockwise numbers: kvpress's protocol, its greedy tokens after the prompt,
and one-block prefills for passkey and RULER. Writes study.json and study_pareto.png to Hydra's output directory and
logs both to W&B.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import hybridcache.checkpoints.real  # noqa: F401 - registers the ${real:NAME} resolver used by model configs
from experiments.core.common import load_model, load_tokenizer
from experiments.core.figure_style import cfg_context
from experiments.core.run_context import RunContext
from experiments.long_context.ruler import TASKS as RULER_TASKS
from experiments.study.data import documents, passkey_prompt
from experiments.study.evaluate import (
    Continuation,
    Strategy,
    block_edges,
    continuation,
    mqar_trial,
    passkey,
    ruler_trial,
    teacher_forced,
)
from experiments.study.report import log_study, pareto_plot, print_ruler_table, print_table, verdict
from experiments.study.strategies import (
    CONTROLS,
    compresses_after_prefill,
    control_for,
    plan_or_error,
    probed,
    references,
    strategy_configs,
)
from experiments.study.summary import mqar_samples, mqar_summary, peak_bytes, ruler_samples, ruler_summary, summarize
from hybridcache.tools.tracking import Tracker

SMOKE = {
    "lengths": [64, 160],
    "block": 32,
    "greedy_tokens": 4,
    "documents": 1,
    "continuation": 16,
    "passkey": {"lengths": [256, 320], "depths": [0.2, 0.8], "trials": 1},  # bytes: the tiny models use ByT5
    "ruler": {
        "tasks": list(RULER_TASKS),
        "lengths": [1800],
        "depths": [0.5],
        "trials": 1,
        "max_new_tokens": 4,
        "strategies": ["native", "snapkv_50"],
    },
    "mqar": {"pairs": [4, 24], "queries": 4, "trials": 1},
}


ENGINE_HF = (
    "HF transformers' own modeling code with our caches (hybridcache.hf.cache_for); the baseline is the native "
    "strategy through the bridge, whose tokens and logits are HF's own DynamicCache's (experiment=correctness "
    "engine=hf checks it on the same checkpoint)"
)


def _load_hf(cfg: DictConfig):
    """(checkpoint, HF's model behind the interface the evaluation calls): engine=hf."""
    from experiments.hf.engine import check_hf_settings, load_hf_model
    from experiments.hf.model import HFModel

    prep = check_hf_settings(cfg, prompts=False)
    return prep["checkpoint"], HFModel(load_hf_model(prep, cfg.model.device))


def run(cfg: DictConfig) -> dict[str, Any]:
    console = Console(width=max(Console().width, 150))
    ctx = RunContext.create(cfg, title=f"study-{cfg.model.family}")
    out_dir = ctx.out_dir
    e = OmegaConf.merge(cfg.experiment, SMOKE) if cfg.experiment.smoke else cfg.experiment
    lengths = sorted({int(L) for L in e.lengths})
    n_cont = int(e.get("continuation") or 0)
    start_time = time.perf_counter()
    with console.status(f"[bold]loading {cfg.model.family}[/]"):
        checkpoint, model = _load_hf(cfg) if cfg.get("engine") == "hf" else load_model(cfg)
        tokenizer = load_tokenizer(checkpoint)
    if cfg.get("engine") == "hf":
        console.print(f"[bold]engine=hf[/]: {ENGINE_HF}")
    random_weights = not cfg.model.checkpoint
    what = (
        f"{cfg.model.family} with RANDOM weights (a tiny test model): perplexity, KL, passkey and RULER say "
        "nothing about real models; only exactness (KL 0, same tokens) is meaningful"
        if random_weights
        else f"{cfg.model.family} from {checkpoint}"
    )
    console.print(f"[bold]study[/]: {what}")

    configs = strategy_configs(e)
    baseline = e.baseline
    plans, rows = {}, {}
    for name, config in configs.items():
        plans[name], error = plan_or_error(model, config)
        if error:
            if name == baseline:
                raise ValueError(f"the baseline strategy '{name}' is not usable: {error}")
            rows[name] = {"name": name, "config": config, "error": error}
    native_plan = plans[baseline]
    same = {n for n, p in plans.items() if p is not None and n != baseline and not p.changed(native_plan)}
    for name in same & set(CONTROLS.values()):  # a control of a part this model lacks (no recurrent layers)
        del configs[name], plans[name]
    same -= set(CONTROLS.values())
    compute = [n for n in configs if n not in rows and n not in same]
    after_prefill = {n for n in compute if n != baseline and compresses_after_prefill(plans[n])}
    blockwise = [n for n in compute if n not in after_prefill]

    def chunk(name: str, tokens: int) -> int:  # a compress-after-prefill cache sees the whole prompt in one block
        return tokens if name in after_prefill else int(e.block)

    docs = documents(
        tokenizer, e.text, max(lengths) + (n_cont + 1 if n_cont else 0), int(e.documents), model.vocab_size
    )
    rng = random.Random(int(e.passkey.seed))
    prompts = [
        (int(L), passkey_prompt(tokenizer, int(L), float(d), rng, int(e.passkey.digits)))
        for L in e.passkey.lengths
        for d in e.passkey.depths
        for _ in range(int(e.passkey.trials))
    ]
    mqar_prompts = mqar_samples(e.mqar, tokenizer, model.vocab_size)
    samples, skipped = ruler_samples(e.ruler, tokenizer, model.vocab_size)
    for note in skipped:  # e.g. a byte-level model: RULER's template alone outgrows a short prompt
        console.print(f"[yellow]RULER: skipped {note}[/]")
    per_doc: dict[str, list[Strategy]] = {n: [] for n in compute}
    cont: dict[str, list[Continuation]] = {n: [] for n in compute}
    trials: dict[str, list[dict]] = {n: [] for n in compute}
    ruler_runs: dict[str, list[dict]] = {n: [] for n in compute}
    mqar_runs: dict[str, list[dict]] = {n: [] for n in compute}
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    phase_s: dict[str, float] = {}  # wall seconds per part: where a bigger setting's time goes
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        phase_s[name], clock = time.perf_counter() - clock, time.perf_counter()

    with Progress(*columns, console=console, transient=True) as progress:
        blocks = len(block_edges(max(lengths), int(e.block), lengths)) - 1
        task = progress.add_task("perplexity, KL, greedy", total=len(docs) * blocks * len(blockwise))
        for doc in docs:
            strategies = [Strategy(n, configs[n]) for n in blockwise]
            teacher_forced(
                model,
                doc[: max(lengths)],
                strategies,
                lengths,
                int(e.block),
                int(e.greedy_tokens),
                lambda: progress.advance(task),
            )
            for s in strategies:
                per_doc[s.name].append(s)
        lap("blockwise")
        if n_cont:
            task = progress.add_task(
                f"kvpress protocol: {n_cont} tokens after the prompt", total=len(docs) * len(lengths) * len(compute)
            )
            for doc in docs:
                runs = [Continuation(n, configs[n]) for n in compute]
                continuation(
                    model,
                    doc,
                    runs,
                    lengths,
                    n_cont,
                    int(e.greedy_tokens),
                    after_prefill | {baseline},
                    lambda: progress.advance(task),
                )
                for r in runs:
                    cont[r.name].append(r)
        lap("kvpress_protocol")
        names = probed(e, "passkey", compute)
        task = progress.add_task("passkey", total=len(prompts) * len(names))
        for name in names:
            for requested, prompt in prompts:
                trials[name].append(
                    {
                        "requested": requested,
                        **passkey(model, tokenizer, prompt, configs[name], chunk(name, len(prompt.ids))),
                    }
                )
                progress.advance(task)
        lap("passkey")
        names = probed(e, "mqar", compute) if mqar_prompts else []
        task = progress.add_task("MQAR", total=len(mqar_prompts) * len(names))
        for name in names:
            for p in mqar_prompts:
                mqar_runs[name].append(mqar_trial(model, p, configs[name], int(e.block), name in after_prefill))
                progress.advance(task)
        lap("mqar")
        names = probed(e, "ruler", compute) if samples else []
        task = progress.add_task("RULER", total=len(samples) * len(names))
        for name in names:
            for sample in samples:
                ruler_runs[name].append(
                    ruler_trial(
                        model,
                        tokenizer,
                        sample,
                        configs[name],
                        chunk(name, len(sample.ids)),
                        e.ruler.get("max_new_tokens"),
                    )
                )
                progress.advance(task)
        lap("ruler")

    native_bytes = peak_bytes(native_plan, max(lengths))
    for name in compute:
        rows[name] = summarize(
            name,
            configs[name],
            plans[name],
            native_plan,
            per_doc[name],
            per_doc[baseline],
            cont[name],
            cont[baseline],
            trials[name],
            trials[baseline],
            lengths,
            native_bytes,
        )
        rows[name].update(ruler_summary(ruler_runs[name]))
        rows[name].update(mqar_summary(mqar_runs[name], mqar_runs[baseline]))
        rows[name]["protocol"] = "prefill" if name in after_prefill else "blockwise"
    for name in same:
        rows[name] = {**rows[baseline], "name": name, "config": configs[name], "same_plan": True}
    ordered = [rows[n] for n in configs]
    insensitive = float(e.get("insensitive_kl", 1e-3))
    for r in ordered:
        r.update(references(e, r["name"]))
        control = control_for(plans[r["name"]], native_plan) if plans.get(r["name"]) is not None else None
        control_row = rows.get(control) if control not in (None, r["name"]) else None
        if control_row is not None and not control_row.get("error"):
            r["control"] = control
        r["verdict"] = verdict(r, rows[baseline], random_weights, control_row, insensitive)

    title = (
        f"study: {cfg.model.family}{' (random weights)' if random_weights else ''}, text '{e.text}', "
        f"{len(docs)} doc(s)"
        + (f", passkey at {list(e.passkey.lengths)} tokens" if prompts else "")
        + (f", MQAR at {list(e.mqar.pairs)} pairs" if mqar_prompts else "")
    )
    plot = pareto_plot(ordered, lengths, out_dir / "study_pareto.png", f"{title}\n{cfg_context(cfg)}", n_cont)
    result = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "checkpoint": checkpoint,
        "engine": {"name": "hf", "baseline": ENGINE_HF} if cfg.get("engine") == "hf" else {"name": "ours"},
        "random_weights": random_weights,
        "text": e.text,
        "lengths": lengths,
        "continuation": n_cont,
        "ruler_tasks": sorted({s.task for s in samples}, key=list(RULER_TASKS).index),
        "ruler_lengths": sorted({s.length for s in samples}),
        "strategies": ordered,
        "wall_s": time.perf_counter() - start_time,
        "phase_s": phase_s,
        "plot": str(plot),
    }
    tracker = ctx.start_tracker(tags=["study", cfg.model.family], config=result["config"])
    log_to_tracker(tracker, ordered, lengths, n_cont, plot)
    run_dir = tracker.run_dir
    tracker.finish()
    result["wandb_dir"] = str(run_dir) if run_dir else None
    json_path = ctx.write(result, "study.json")
    print_table(console, ordered, lengths, n_cont, title)
    print_ruler_table(console, ordered)
    console.print(
        f"plot: {plot}\nW&B run: {run_dir}\nresults: {json_path}\nwall time: {result['wall_s']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in phase_s.items())
        + ")"
    )
    return result


def log_to_tracker(tracker: Tracker, rows: list[dict], lengths: list[int], n_cont: int, plot: Path) -> None:
    longest = str(max(lengths))
    columns = [
        "strategy",
        "config",
        "protocol",
        "bytes",
        "bytes_vs_native",
        *[f"ppl@{L}" for L in lengths],
        f"kl@{longest}",
        f"top1@{longest}",
        f"cont{n_cont}_ppl@{longest}",
        f"cont{n_cont}_kl@{longest}",
        "passkey_acc",
        "mqar_acc",
        "ruler_mean",
        "reference",
        "agreement",
        "verdict",
    ]
    table = []
    for r in rows:
        if r.get("error"):
            table.append(
                [
                    r["name"],
                    json.dumps(r["config"]),
                    None,
                    None,
                    None,
                    *[None] * len(lengths),
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    r.get("reference"),
                    r.get("agreement"),
                    r["verdict"],
                ]
            )
            continue
        table.append(
            [
                r["name"],
                json.dumps(r["config"]),
                r.get("protocol"),
                r["bytes"],
                r["bytes_ratio"],
                *[r["ppl"].get(str(L)) for L in lengths],
                r["kl"].get(longest),
                r["top1"].get(longest),
                r["continuation_ppl"].get(longest),
                r["continuation_kl"].get(longest),
                r["passkey_acc"],
                r.get("mqar_acc"),
                r.get("ruler_mean"),
                r.get("reference"),
                None if r.get("agreement") is None else str(r["agreement"]),
                r["verdict"],
            ]
        )
        tracker.summary(
            {
                f"{r['name']}/bytes_vs_native": r["bytes_ratio"],
                f"{r['name']}/ppl@{longest}": r["ppl"].get(longest),
                f"{r['name']}/kl@{longest}": r["kl"].get(longest),
                f"{r['name']}/cont_ppl@{longest}": r["continuation_ppl"].get(longest),
                f"{r['name']}/passkey_acc": r["passkey_acc"],
                f"{r['name']}/mqar_acc": r.get("mqar_acc"),
                f"{r['name']}/ruler_mean": r.get("ruler_mean"),
                **{
                    f"{r['name']}/ruler/{task}@{L}": v
                    for task, by in (r.get("ruler") or {}).items()
                    for L, v in by.items()
                },
            }
        )
    tracker.table("study", columns, table)
    log_study(tracker, rows, lengths, plot)  # the figure as an image and as native W&B scatter plots
