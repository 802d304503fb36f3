"""The training loop of experiment=train, free of Hydra: settings, a resumable run, evaluation in bits per byte.

Resuming is exact: the batch of step s is a pure function of (seed, s) (experiments/train/data.py), and a checkpoint
holds the weights, the optimizer's moments, torch's RNG state, the step and the history, written atomically (a
temporary file renamed into place), so an interrupted run continues with the same losses an uninterrupted one gets.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from experiments.core import mqar
from experiments.train.data import BYTE_OFFSET, Corpus, batch, recall_batch, windows
from experiments.train.model import hf_model, parameter_count

LN2 = math.log(2.0)
CHECKPOINT = "checkpoint.pt"


class TrainError(RuntimeError):
    """A run directory that belongs to other settings, or a checkpoint that cannot be resumed."""


@dataclass
class TrainSettings:
    """Everything that decides the trained weights (the run directory is keyed by it)."""

    arch: str = "hybrid"
    size: dict[str, Any] = field(default_factory=dict)
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    mix: dict[str, float] = field(default_factory=lambda: {"shakespeare": 0.35, "docstrings": 0.45, "pydoc": 0.2})
    eval_len: int = 512
    eval_windows: int = 64  # per split, at the end
    probe_windows: int = 8  # per split, every eval_every steps (the curve)
    control_windows: int = (
        8  # per split, at the end: states dropped after every byte (experiments/study/state_control.py)
    )
    eval_every: int = 100
    checkpoint_every: int = 50
    # The recall phase: `recall_steps` more steps after `steps`, each batch `recall_batch_size` windows of
    # `recall_seq_len` bytes of which a `recall_share` are MQAR examples scored on their answers only (Zoology's
    # training; experiments/core/mqar.py); its own warm-up and cosine from `recall_lr`. 0: text only.
    recall_steps: int = 0
    recall_share: float = 0.5
    recall_lr: float = 1e-3
    recall_warmup: int = 10
    recall_seq_len: int = 512
    recall_batch_size: int = 4
    recall_max_pairs: int = 32
    # Attention restricted to the last `attention_window` bytes (sliding, q - W < kv <= q) in training and
    # evaluation, so whatever lies further back must reach the model through its recurrent state. None: full.
    attention_window: int | None = None
    # How the Mamba2 time steps and decays start: "hf" (HF's Bamba init: the state forgets within a few bytes) or
    # "mamba" (the Mamba2 reference's: dt in [1e-3, 0.1], A in [1, 16]; train_model.mamba_ssm_init).
    ssm_init: str = "hf"

    @property
    def total_steps(self) -> int:
        return self.steps + self.recall_steps

    def key(self) -> dict[str, Any]:
        """What the weights depend on (not how often we look at them). Without a recall phase the recall settings
        are left out, so the text-only phase of a run is keyed as a text-only run is (and can be continued)."""
        d = asdict(self)
        for k in ("eval_windows", "probe_windows", "eval_every", "checkpoint_every", "eval_len", "control_windows"):
            d.pop(k)
        if not self.recall_steps:
            d = {k: v for k, v in d.items() if not k.startswith("recall_")}
        if self.attention_window is None or self.arch == "recurrent":  # (no attention: the window changes nothing)
            d.pop("attention_window")  # runs keyed before this setting existed keep their keys
        if self.ssm_init == "hf":
            d.pop("ssm_init")
        if d["size"].get("conv", 4) == 4:  # likewise runs keyed before the conv kernel was a setting
            d["size"] = {k: v for k, v in d["size"].items() if k != "conv"}
        return d

    def text_phase(self) -> TrainSettings:
        """The same run without its recall phase: its checkpoint at `steps` is this run's state at `steps`."""
        return replace(self, recall_steps=0)


def learning_rate(s: TrainSettings, step: int) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at the last step; the recall phase likewise, from
    recall_lr over its own steps."""
    if step >= s.steps:
        r = step - s.steps
        if r < s.recall_warmup:
            return s.recall_lr * (r + 1) / s.recall_warmup
        t = (r - s.recall_warmup) / max(1, s.recall_steps - s.recall_warmup)
        return s.recall_lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def make_optimizer(model: torch.nn.Module, s: TrainSettings) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms, biases, SSM decay / time-step / skip parameters)."""
    params = {id(p): (n, p) for n, p in model.named_parameters()}.values()
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=s.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def model_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of `ids` [B, T]; with `config.attention_window` = W, every attention layer sees only the
    last W positions (a [B, 1, T, T] boolean band: HF's Bamba takes it as is; equal to our Bamba with a sliding
    cache of window W, checked in tests/app/test_train.py)."""
    window = getattr(getattr(model, "config", None), "attention_window", None)
    # HF models: use_cache=False (training needs no cache, and HF's needs an attention layer to count tokens)
    hf = {"use_cache": False} if isinstance(model, transformers.PreTrainedModel) else {}
    if not window:
        return model(ids, **hf).logits
    t = ids.shape[1]
    q, kv = torch.arange(t)[:, None], torch.arange(t)[None, :]
    band = (kv <= q) & (q - kv < window)  # [T, T]
    return model(ids, attention_mask=band.expand(ids.shape[0], 1, t, t), **hf).logits


def next_byte_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of a [B, T + 1] batch."""
    logits = model_logits(model, ids[:, :-1])  # [B, T, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def recall_losses(
    model: torch.nn.Module, ids: torch.Tensor, answers: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-byte cross-entropy of the text rows, mean cross-entropy of the MQAR answers) of a recall-phase
    batch: [B, T + 1] ids, [B, T] answer mask (rows with any answer are MQAR rows)."""
    logits = model_logits(model, ids[:, :-1]).float()  # [B, T, V]
    ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T]
    recall_rows = answers.any(dim=1)
    text = ce[~recall_rows].mean() if (~recall_rows).any() else ce.new_zeros(())
    return text, ce[answers].mean()


@torch.no_grad()
def mqar_accuracy(model: torch.nn.Module, pairs: int, examples: int, seed: str = "held-out") -> float:
    """Share of MQAR queries whose value byte is the argmax prediction (teacher-forced, Zoology's measure),
    on `examples` examples of `pairs` pairs, every key queried; seeded apart from training's examples."""
    was = model.training
    model.eval()
    rng, hit, total = random.Random(f"{seed}-{pairs}"), 0, 0
    for _ in range(examples):
        ex = mqar.example(rng, pairs, pairs)
        ids = torch.tensor([list(ex.text)]) + BYTE_OFFSET
        pred = model_logits(model, ids)[0].argmax(-1)  # pred[i] predicts ids[i + 1]
        for at, _ in ex.answers:
            hit += bool(pred[at - 1] == ids[0, at])
            total += 1
    model.train(was)
    return hit / total


@torch.no_grad()
def bits_per_byte(model: torch.nn.Module, tokens: np.ndarray, length: int, count: int, batch_size: int = 8) -> float:
    """Mean next-byte NLL in bits over the first `count` windows of `length` bytes (one id = one byte)."""
    was = model.training
    model.eval()
    rows = torch.from_numpy(windows(tokens, length, count))
    total = 0.0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        total += next_byte_loss(model, chunk).item() * len(chunk)
    model.train(was)
    return total / len(rows) / LN2


def eval_splits(corpus: Corpus) -> dict[str, np.ndarray]:
    """The held-out splits by name: in-domain per source, and the unseen prose."""
    return {**{f"eval/{k}": v for k, v in corpus.eval.items()}, "unseen/pydoc": corpus.unseen}


@dataclass
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)  # one row per step
    probes: list[dict[str, float]] = field(default_factory=list)  # held-out bits/byte every eval_every steps
    seconds: float = 0.0  # training wall time so far, over every session


def fresh_state(s: TrainSettings) -> TrainState:
    model = hf_model(s.arch, s.size, s.seed, s.attention_window, s.ssm_init)
    return TrainState(model, make_optimizer(model, s))


def save_checkpoint(state: TrainState, s: TrainSettings, run_dir: Path) -> Path:
    """Atomically write everything needed to continue (weights, optimizer, RNG, step, history)."""
    path = run_dir / CHECKPOINT
    tmp = run_dir / f".{CHECKPOINT}.{os.getpid()}.tmp"
    torch.save(
        {
            "settings": s.key(),
            "step": state.step,
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "history": state.history,
            "probes": state.probes,
            "seconds": state.seconds,
        },
        tmp,
    )
    os.replace(tmp, path)
    return path


def load_state(s: TrainSettings, run_dir: Path, text_phase_dir: Path | None = None) -> TrainState:
    """The checkpoint in `run_dir` if there is one (it must come from the same settings); else, for a run with a
    recall phase, the finished text-only run in `text_phase_dir` (its state at `steps` is this run's); else a fresh
    start."""
    state = fresh_state(s)
    path, expected, continued = run_dir / CHECKPOINT, s.key(), False
    if not path.is_file():
        if not (s.recall_steps and text_phase_dir and (text_phase_dir / CHECKPOINT).is_file()):
            return state
        path, expected, continued = text_phase_dir / CHECKPOINT, s.text_phase().key(), True
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if saved["settings"] != json.loads(json.dumps(expected)):
        raise TrainError(f"{path} was written with other settings; use another run directory or delete it")
    if continued and saved["step"] != s.steps:
        return state  # an unfinished text phase elsewhere: this run trains its own
    state.model.load_state_dict(saved["model"])
    state.optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["torch_rng"])
    state.step, state.history, state.probes = saved["step"], saved["history"], saved["probes"]
    state.seconds = saved.get("seconds", 0.0)
    return state


def train(
    s: TrainSettings,
    corpus: Corpus,
    run_dir: Path,
    stop_at: int | None = None,
    on_step: Callable[[TrainState, dict[str, float]], None] | None = None,
    text_phase_dir: Path | None = None,
) -> TrainState:
    """Train (resuming from `run_dir`, or continuing a finished text phase in `text_phase_dir`) up to step `stop_at`
    (default: all steps, the recall phase's included), checkpointing every `checkpoint_every` steps and at the end;
    held-out probes every `eval_every` steps (MQAR accuracy too in the recall phase)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    state = load_state(s, run_dir, text_phase_dir)
    splits = eval_splits(corpus)
    end = min(s.total_steps, stop_at if stop_at is not None else s.total_steps)
    model, opt = state.model, state.optimizer
    model.train()
    while state.step < end:
        start = time.perf_counter()
        recall = state.step >= s.steps
        size, length = (s.recall_batch_size, s.recall_seq_len) if recall else (s.batch_size, s.seq_len)
        lr = learning_rate(s, state.step)
        for group in opt.param_groups:
            group["lr"] = lr
        if recall:
            ids, answers = recall_batch(
                corpus.train, s.mix, size, length, s.seed, state.step, s.recall_share, s.recall_max_pairs
            )
            loss, recall_loss = recall_losses(model, torch.from_numpy(ids), torch.from_numpy(answers))
            total = loss + recall_loss
        else:
            loss = total = next_byte_loss(
                model, torch.from_numpy(batch(corpus.train, s.mix, size, length, s.seed, state.step))
            )
        opt.zero_grad(set_to_none=True)
        total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip).item()
        opt.step()
        seconds = time.perf_counter() - start
        state.seconds += seconds
        state.step += 1
        tokens = (state.history[-1]["tokens"] if state.history else 0) + size * length
        row = {
            "step": state.step,
            "loss": loss.item(),
            "bits_per_byte": loss.item() / LN2,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "tokens_per_s": size * length / seconds,
        }
        if recall:
            row["recall_loss"] = recall_loss.item()
        state.history.append(row)
        if state.step % s.eval_every == 0 or state.step in (s.steps, s.total_steps):
            probe = {"step": state.step, "tokens": row["tokens"]}
            probe.update({k: bits_per_byte(model, v, s.eval_len, s.probe_windows) for k, v in splits.items()})
            if s.recall_steps:
                probe["mqar/16_pairs"] = mqar_accuracy(model, 16, 4)
            state.probes.append(probe)
            row = {**row, **{k: v for k, v in probe.items() if "/" in k}}
        if state.step % s.checkpoint_every == 0 or state.step == end:
            save_checkpoint(state, s, run_dir)
        if on_step is not None:
            on_step(state, row)
    return state


def final_eval(state: TrainState, s: TrainSettings, corpus: Corpus, length: int | None = None) -> dict[str, float]:
    """Held-out bits per byte on `eval_windows` windows of `length` bytes (default eval_len) of every split."""
    length = length or s.eval_len
    return {k: bits_per_byte(state.model, v, length, s.eval_windows) for k, v in eval_splits(corpus).items()}


def describe(state: TrainState) -> dict[str, Any]:
    return {"parameters": parameter_count(state.model), "step": state.step, "train_seconds": state.seconds}
