"""experiment=study: what a cache strategy costs. Memory held against quality, on the same text, per strategy.

Bytes are the peak a batch-1 cache holds over the context (`CachePlan.held_nbytes`, equal to `cache.nbytes()` after
the run, which study.json keeps as `bytes_after`). A strategy is a named cache-config mapping in configs/experiment/study.yaml (`strategies:`); a new one (a new cache
type, a storage format, a per-layer mix) is one more YAML entry, no code. For each strategy and context length:
cache bytes held (and vs native), teacher-forced perplexity on long documents, KL from native's next-token
distribution, top-1 and greedy agreement with native, and passkey retrieval accuracy (see experiments/study_eval.py).
Writes study.json and study_pareto.png to Hydra's output directory and logs both to W&B.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import hybridcache.real_checkpoints  # noqa: F401 - registers the ${real:NAME} resolver used by model configs
from experiments.common import load_model, load_tokenizer
from experiments.study_data import documents, passkey_prompt
from experiments.study_eval import Strategy, agreement, block_edges, passkey, prefix_max, prefix_mean, teacher_forced
from experiments.study_report import finite, pareto_plot, print_table, verdict
from hybridcache.cache import resolve_plan
from hybridcache.tracking import Tracker

SMOKE = {"lengths": [64, 160], "block": 32, "greedy_tokens": 4, "documents": 1,
         "passkey": {"lengths": [256, 320], "depths": [0.2, 0.8], "trials": 1}}  # bytes: the tiny models use ByT5


def strategy_configs(e: DictConfig) -> dict[str, dict[str, Any]]:
    """Name -> cache config, the reference strategy first (added as the native `{}` when not listed)."""
    raw = OmegaConf.to_container(e.strategies, resolve=True) or {}
    only = list(e.only) if e.get("only") else None
    if only:
        unknown = [n for n in only if n not in raw and n != e.reference]
        if unknown:
            raise ValueError(f"experiment.only names unknown strategies {unknown} (known: {', '.join(raw)})")
    ref = e.reference
    out = {ref: raw.get(ref) or {}}
    for name, config in raw.items():
        if name != ref and (only is None or name in only):
            out[name] = config or {}
    return out


def passkey_strategies(e: DictConfig, compute: list[str]) -> list[str]:
    """The strategies the passkey test runs for: `passkey.strategies` (null: all), the reference always."""
    names = e.passkey.get("strategies")
    if names is None:
        return list(compute)
    unknown = [n for n in names if n not in e.strategies]
    if unknown:
        raise ValueError(f"experiment.passkey.strategies names unknown strategies {unknown}")
    return [n for n in compute if n in set(names) or n == e.reference]


def plan_or_error(model, config: dict[str, Any]):
    try:
        return resolve_plan(model.native_layers(), config), None
    except Exception as err:  # noqa: BLE001 - an unknown or inapplicable type: the row says why, the study goes on
        return None, f"{type(err).__name__}: {str(err).splitlines()[0]}"


def run(cfg: DictConfig) -> dict[str, Any]:
    console = Console(width=max(Console().width, 150))
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    e = OmegaConf.merge(cfg.experiment, SMOKE) if cfg.experiment.smoke else cfg.experiment
    lengths = sorted({int(L) for L in e.lengths})
    start_time = time.perf_counter()
    with console.status(f"[bold]loading {cfg.model.family}[/]"):
        checkpoint, model = load_model(cfg)
        tokenizer = load_tokenizer(checkpoint)
    random_weights = not cfg.model.checkpoint
    what = (f"{cfg.model.family} with RANDOM weights (a tiny test model): perplexity, KL and passkey say nothing "
            "about real models; only exactness (KL 0, same tokens) is meaningful" if random_weights
            else f"{cfg.model.family} from {checkpoint}")
    console.print(f"[bold]study[/]: {what}")

    configs = strategy_configs(e)
    ref_name = e.reference
    plans, rows = {}, {}
    for name, config in configs.items():
        plans[name], error = plan_or_error(model, config)
        if error:
            if name == ref_name:
                raise ValueError(f"the reference strategy '{name}' is not usable: {error}")
            rows[name] = {"name": name, "config": config, "error": error}
    native_plan = plans[ref_name]
    same = {n for n, p in plans.items() if p is not None and n != ref_name and not p.changed(native_plan)}
    compute = [n for n in configs if n not in rows and n not in same]

    docs = documents(tokenizer, e.text, max(lengths), int(e.documents), model.vocab_size)
    rng = random.Random(int(e.passkey.seed))
    prompts = [(int(L), passkey_prompt(tokenizer, int(L), float(d), rng, int(e.passkey.digits)))
               for L in e.passkey.lengths for d in e.passkey.depths for _ in range(int(e.passkey.trials))]
    per_doc: dict[str, list[Strategy]] = {n: [] for n in compute}
    trials: dict[str, list[dict]] = {n: [] for n in compute}
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        blocks = len(block_edges(max(lengths), int(e.block), lengths)) - 1
        task = progress.add_task("perplexity, KL, greedy", total=len(docs) * blocks * len(compute))
        for doc in docs:
            strategies = [Strategy(n, configs[n]) for n in compute]
            teacher_forced(model, doc, strategies, lengths, int(e.block), int(e.greedy_tokens),
                           lambda: progress.advance(task))
            for s in strategies:
                per_doc[s.name].append(s)
        probed = passkey_strategies(e, compute)
        task = progress.add_task("passkey", total=len(prompts) * len(probed))
        for name in probed:
            for requested, prompt in prompts:
                trials[name].append({"requested": requested,
                                     **passkey(model, tokenizer, prompt, configs[name], int(e.block))})
                progress.advance(task)

    native_bytes = peak_bytes(native_plan, max(lengths))
    for name in compute:
        rows[name] = summarize(name, configs[name], plans[name], native_plan, per_doc[name], per_doc[ref_name], trials[name],
                               trials[ref_name], lengths, native_bytes)
    for name in same:
        rows[name] = {**rows[ref_name], "name": name, "config": configs[name], "same_plan": True}
    ordered = [rows[n] for n in configs]
    for r in ordered:
        r["verdict"] = verdict(r, rows[ref_name], random_weights)

    title = (f"study: {cfg.model.family}{' (random weights)' if random_weights else ''}, text '{e.text}', "
             f"{len(docs)} doc(s), passkey at {list(e.passkey.lengths)} tokens")
    plot = pareto_plot(ordered, lengths, out_dir / "study_pareto.png", title)
    result = {"config": OmegaConf.to_container(cfg, resolve=True), "checkpoint": checkpoint,
              "random_weights": random_weights, "text": e.text, "lengths": lengths, "strategies": ordered,
              "wall_s": time.perf_counter() - start_time, "plot": str(plot)}
    tracker = Tracker(cfg.logger.mode, cfg.logger.project, out_dir, result["config"], group=cfg.logger.group,
                      name=f"study-{cfg.model.family}", tags=["study", cfg.model.family])
    log_to_tracker(tracker, ordered, lengths, plot)
    run_dir = tracker.run_dir
    tracker.finish()
    result["wandb_dir"] = str(run_dir) if run_dir else None
    json_path = out_dir / "study.json"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    print_table(console, ordered, lengths, title)
    console.print(f"plot: {plot}\nW&B run: {run_dir}\nresults: {json_path}\nwall time: {result['wall_s']:.0f} s")
    return result


def summarize(name, config, plan, native_plan, docs: list[Strategy], native_docs: list[Strategy], trials, native_trials,
              lengths: list[int], native_bytes: int) -> dict[str, Any]:
    """One strategy's row: per context length, means over documents."""
    ppl, kl, kl_max, top1, greedy, diverges = {}, {}, {}, {}, {}, {}
    for L in lengths:
        n = L - 1
        ppl[str(L)] = math.exp(sum(prefix_mean(d.nll, n) for d in docs) / len(docs))
        kl[str(L)] = sum(prefix_mean(d.kl, n) for d in docs) / len(docs)
        kl_max[str(L)] = max(prefix_max(d.kl, n) for d in docs)
        top1[str(L)] = sum(prefix_mean([t.float() for t in d.top1], n) for d in docs) / len(docs)
        if docs[0].greedy:
            pairs = [agreement(d.greedy[L], nd.greedy[L]) for d, nd in zip(docs, native_docs)]
            greedy[str(L)] = sum(a for a, _ in pairs) / len(pairs)
            steps = [s for _, s in pairs if s is not None]
            diverges[str(L)] = min(steps) if steps else None
    for t, nt in zip(trials, native_trials):
        t["native_correct"] = nt["correct"]
    correct = sum(t["correct"] for t in trials)
    by_length: dict[str, list[int]] = {}
    for t in trials:  # per requested prompt length: [correct, trials]
        cell = by_length.setdefault(str(t["requested"]), [0, 0])
        cell[0] += int(t["correct"])
        cell[1] += 1
    peak = peak_bytes(plan, max(lengths))
    return {"name": name, "config": config, "exact_cache": plan.exact, "changed_layers": plan.changed(native_plan),
            "bytes": peak, "bytes_ratio": peak / native_bytes if native_bytes else float("nan"),
            "bytes_after": docs[0].nbytes_after,
            "planned_bytes": {str(L): plan.held_nbytes(1, L) for L in lengths},
            "peak_bytes": {str(L): peak_bytes(plan, L) for L in lengths},
            "ppl": ppl, "kl": kl, "kl_max": {k: finite(v) for k, v in kl_max.items()}, "top1": top1,
            "greedy_agreement": greedy, "greedy_diverges_at": diverges,
            "greedy_tokens": {str(L): docs[0].greedy.get(L) for L in lengths},
            "passkey": trials, "passkey_correct": correct, "passkey_trials": len(trials),
            "passkey_by_length": by_length,
            "passkey_acc": correct / len(trials) if trials else None}


def peak_bytes(plan, tokens: int) -> int:
    """The most bytes the cache holds between blocks at batch 1 over a sequence of `tokens` tokens (from the specs;
    a chunked cache is empty right after a chunk boundary, so its bytes after the run say little)."""
    return max(plan.held_nbytes(1, t) for t in range(1, tokens + 1))


def log_to_tracker(tracker: Tracker, rows: list[dict], lengths: list[int], plot: Path) -> None:
    longest = str(max(lengths))
    columns = ["strategy", "config", "bytes", "bytes_vs_native", *[f"ppl@{L}" for L in lengths], f"kl@{longest}",
               f"top1@{longest}", "passkey_acc", "verdict"]
    table = []
    for r in rows:
        if r.get("error"):
            table.append([r["name"], json.dumps(r["config"]), None, None, *[None] * len(lengths), None, None, None,
                          r["verdict"]])
            continue
        table.append([r["name"], json.dumps(r["config"]), r["bytes"], r["bytes_ratio"],
                      *[r["ppl"][str(L)] for L in lengths], r["kl"][longest], r["top1"][longest], r["passkey_acc"],
                      r["verdict"]])
        tracker.summary({f"{r['name']}/bytes_vs_native": r["bytes_ratio"], f"{r['name']}/ppl@{longest}":
                         r["ppl"][longest], f"{r['name']}/kl@{longest}": r["kl"][longest],
                         f"{r['name']}/passkey_acc": r["passkey_acc"]})
    tracker.table("study", columns, table)
    if tracker.mode != "disabled":
        tracker.log({"study_pareto": tracker.wandb.Image(str(plot))})
