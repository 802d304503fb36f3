"""kvpress's decoding-time presses as a live reference: DecodingPress (and PrefillDecodingPress) around one press, run
by the kvpress worker in its own environment (kvpress_runner.py has the environment, the process handling and the
prefill-only presses).

    result = run_decoding_press(checkpoint_dir, context_ids, continuation_ids, press="tova", budget=256,
                                compression_interval=16)
    result.events[5]    # [(continuation step, [Hkv, n_kept] positions layer 5 held after that compression), ...]
    result.held[5]      # [Hkv, S] positions layer 5 holds after the whole continuation
    result.nll          # [T_cont] teacher-forced NLL, the continuation fed one token per forward under the press
    result.greedy       # [greedy] tokens greedy decoding picks after the context under the same press

The worker follows each layer's cache slots back to original positions through every compression (kvpress gathers
kept slots in topk order, so slot i is not position i after the first one); its files are untrusted input, checked
here against what was asked.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridcache.cache.methods.press_schedule import DECODING_SCHEDULES
from hybridcache.reference.kvpress_runner import (
    WORKER,
    KvpressTimeout,
    KvpressUnavailable,
    KvpressWorkerError,
    _ids,
    find_kvpress_python,
    install_commands,
    read_worker_files,
)
from hybridcache.reference.vllm_runner import root_cause, run_worker

DECODING_PRESSES = ("knorm", "tova", "streaming_llm")  # the methods whose decoding schedules we offer (spec.decodes)
_TENSOR_NAME = re.compile(r"^(?:held\.(\d+)|event\.(\d+)\.(\d+)|nll|greedy)$")


@dataclass(frozen=True)
class KvpressDecodingResult:
    """One decoding-time press on one context. `error` is set (nll None) when kvpress itself failed."""

    press: str
    schedule: str
    held: dict[int, torch.Tensor]  # layer -> [Hkv, S] positions held after the continuation, ascending per head
    events: dict[int, list[tuple[int, torch.Tensor]]]  # layer -> (step, [Hkv, n] positions) per compression
    nll: torch.Tensor | None  # [T_cont] float32
    greedy: torch.Tensor | None  # [n] int64
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def run_decoding_press(
    checkpoint_dir: str | Path,
    context_ids: Sequence[int] | torch.Tensor,
    continuation_ids: Sequence[int] | torch.Tensor,
    press: str,
    budget: int,
    compression_interval: int,
    schedule: str = "decoding",
    compression_ratio: float | None = None,
    *,
    greedy: int = 0,
    python: str | None = None,
    dtype: str = "float32",
    timeout: float = 900,
    threads: int | None = None,
    **press_kwargs: Any,
) -> KvpressDecodingResult:
    """kvpress's DecodingPress(`press`, compression_interval, target_size=budget) (schedule "decoding"), or
    PrefillDecodingPress(`press` at compression_ratio, that DecodingPress) (schedule "prefill_decoding"): the context
    prefilled, then `continuation_ids` one token per forward under the press (teacher-forced), and with `greedy`,
    that many tokens decoded greedily after the context under a fresh press. Extra keyword arguments (n_sink) go
    to the press; sdpa attention (the three presses read keys or recompute the last query's attention)."""
    if press not in DECODING_PRESSES:
        raise ValueError(f"no decoding check for press {press!r} (known: {', '.join(DECODING_PRESSES)})")
    if schedule not in DECODING_SCHEDULES:
        raise ValueError(f"schedule must be one of {DECODING_SCHEDULES}, not {schedule!r}")
    for name, value in (("budget", budget), ("compression_interval", compression_interval)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(greedy, bool) or not isinstance(greedy, int) or greedy < 0:
        raise ValueError(f"greedy must be a non-negative integer, got {greedy!r}")
    if (schedule == "prefill_decoding") != (compression_ratio is not None):
        raise ValueError("compression_ratio is the prefill's: give it with schedule 'prefill_decoding' only")
    interpreter = find_kvpress_python(python)
    context, continuation = _ids(context_ids, "context_ids"), _ids(continuation_ids, "continuation_ids")
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    if compression_ratio is not None:
        press_kwargs = {"compression_ratio": float(compression_ratio), **press_kwargs}
    request = {
        "checkpoint": str(Path(checkpoint_dir).resolve()),
        "context_ids": context,
        "continuation_ids": continuation,
        "press": press,
        "press_kwargs": press_kwargs,
        "decoding": {
            "compression_interval": compression_interval,
            "target_size": budget,
            "prefill": schedule == "prefill_decoding",
        },
        "greedy": greedy,
        "attn_implementation": "sdpa",
        "dtype": dtype,
        "feed": "per_token",
        "threads": threads,
    }
    with tempfile.TemporaryDirectory(prefix="kvpress-decoding-") as tmp:
        req, ans, res = Path(tmp) / "request.json", Path(tmp) / "answer.json", Path(tmp) / "result.safetensors"
        req.write_text(json.dumps(request))
        started = time.perf_counter()
        try:
            code, stdout, stderr = run_worker(
                [interpreter, str(WORKER), str(req), str(ans), str(res)], timeout, Path(tmp), label="kvpress"
            )
        except TimeoutError as e:
            raise KvpressTimeout(str(e)) from None
        except OSError as e:
            raise KvpressUnavailable(f"{interpreter} did not start ({e}); create one with: {install_commands()}") from e
        wall_s = time.perf_counter() - started
        if not ans.exists():
            raise KvpressWorkerError(f"the kvpress worker failed (exit {code}): {root_cause(stderr, stdout)}")
        return read_decoding_answer(ans, res, press, schedule, len(context), len(continuation), greedy, config, wall_s)


def read_decoding_answer(
    answer_path: Path,
    result_path: Path,
    press: str,
    schedule: str,
    context_len: int,
    continuation_len: int,
    greedy: int,
    config: dict,
    wall_s: float = 0.0,
) -> KvpressDecodingResult:
    """Parse and check the worker's files: positions int64 [Hkv, n], distinct and ascending per head, below
    context + continuation; compression steps inside the continuation (-1: the prefill, prefill_decoding only),
    increasing, one tensor each; NLL and greedy tokens of the lengths asked."""
    meta, error, tensors = read_worker_files(answer_path, result_path)
    layers = int(config["num_hidden_layers"])
    heads = int(config.get("num_key_value_heads", config["num_attention_heads"]))
    limit = context_len + continuation_len
    held, found = {}, {}
    for name, value in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise KvpressWorkerError(f"unexpected tensor {name!r} in the kvpress result")
        if name in ("nll", "greedy"):
            continue
        layer = int(match.group(1) if match.group(1) is not None else match.group(2))
        if layer >= layers:
            raise KvpressWorkerError(f"unexpected tensor {name!r} in the kvpress result ({layers} layers)")
        _check_positions(name, value, heads, limit)
        if match.group(1) is not None:
            held[layer] = value
        else:
            found.setdefault(layer, {})[int(match.group(3))] = value
    events = _events(meta, found, schedule, continuation_len)
    nll = greedy_ids = None
    if error is None:
        nll = tensors.get("nll")
        if nll is None or nll.dtype != torch.float32 or tuple(nll.shape) != (continuation_len,):
            raise KvpressWorkerError(f"the kvpress NLL is missing or not float32 [{continuation_len}]")
        if not (torch.isfinite(nll).all() and (nll >= 0).all()):
            raise KvpressWorkerError("the kvpress NLL has non-finite or negative values")
        if not math.isclose(float(nll.mean()), float(meta.get("mean_nll", math.nan)), rel_tol=1e-5, abs_tol=1e-6):
            raise KvpressWorkerError("the kvpress meta's mean_nll disagrees with its NLL tensor")
        if sorted(held) != list(range(layers)):
            raise KvpressWorkerError("the kvpress result lacks the held positions of some layer")
        if greedy:
            greedy_ids = tensors.get("greedy")
            if greedy_ids is None or greedy_ids.dtype != torch.int64 or tuple(greedy_ids.shape) != (greedy,):
                raise KvpressWorkerError(f"the kvpress greedy tokens are missing or not int64 [{greedy}]")
            if bool((greedy_ids < 0).any()) or bool((greedy_ids >= int(config["vocab_size"])).any()):
                raise KvpressWorkerError("the kvpress greedy tokens lie outside the vocabulary")
    return KvpressDecodingResult(
        press, schedule, dict(sorted(held.items())), events, nll, greedy_ids, meta, error, wall_s
    )


def _check_positions(name: str, value: torch.Tensor, heads: int, limit: int) -> None:
    if value.dtype != torch.int64 or value.dim() != 2 or value.shape[0] != heads:
        got = f"{value.dtype} {list(value.shape)}"
        raise KvpressWorkerError(f"kvpress {name}: positions must be int64 [{heads}, n], not {got}")
    if value.numel() and (value.min() < 0 or value.max() >= limit or not (value[:, 1:] > value[:, :-1]).all()):
        raise KvpressWorkerError(f"kvpress {name}: positions must be distinct, ascending, in [0, {limit})")


def _events(meta: dict, found: dict, schedule: str, continuation_len: int) -> dict[int, list[tuple[int, torch.Tensor]]]:
    steps_of = meta.get("events") or {}
    if not isinstance(steps_of, dict):
        raise KvpressWorkerError("the kvpress meta's events is not an object")
    events = {}
    for key, steps in steps_of.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) in found):
            raise KvpressWorkerError(f"the kvpress meta names compressions of layer {key!r} it has no tensors for")
        layer, tensors = int(key), found[int(key)]
        if not isinstance(steps, list) or len(steps) != len(tensors) or set(tensors) != set(range(len(steps))):
            raise KvpressWorkerError(f"kvpress layer {layer}: the compression steps and tensors disagree")
        first = -1 if schedule == "prefill_decoding" else 0
        if any(isinstance(s, bool) or not isinstance(s, int) or not first <= s < continuation_len for s in steps):
            raise KvpressWorkerError(f"kvpress layer {layer}: a compression step outside [{first}, {continuation_len})")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise KvpressWorkerError(f"kvpress layer {layer}: the compression steps are not increasing")
        events[layer] = [(s, tensors[k]) for k, s in enumerate(steps)]
    if set(found) - set(events):
        raise KvpressWorkerError("the kvpress result has compression tensors the meta does not name")
    return dict(sorted(events.items()))
