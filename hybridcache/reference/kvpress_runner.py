"""NVIDIA's kvpress as a live reference for lossy KV caches, run in its own environment as a subprocess.

kvpress patches attention functions globally and pins transformers 5.2, so it never enters our process: the worker
(`kvpress_worker.py`, run by that environment's python) prefills a context under one press, recovers which original
positions each layer kept, and scores a continuation; it answers with JSON metadata and a safetensors file, both read
here as untrusted input. The process group is ended on timeout, failure or interrupt (the vLLM runner's helpers).

    result = run_press(checkpoint_dir, context_ids, continuation_ids, press="snapkv", compression_ratio=0.5)
    result.kept[5]      # [Hkv, n_kept] original positions layer 5 kept, ascending
    result.nll          # [T_cont] teacher-forced NLL of each continuation token
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridcache.reference.vllm_runner import root_cause, run_worker

WORKER = Path(__file__).with_name("kvpress_worker.py")
ENV_VAR = "HYBRIDCACHE_KVPRESS_PYTHON"
SUPPORTED_KVPRESS = ("0.5.5",)
# Our cache type names (the worker maps them to kvpress classes; a test checks both lists agree).
PRESS_NAMES = (
    "streaming_llm",
    "snapkv",
    "knorm",
    "tova",
    "observed_attention",
    "expected_attention",
    "pyramidkv",
    "none",
)
FEEDS = ("one_forward", "per_token")
MAX_RESULT_BYTES = 256 * 2**20
_TENSOR_NAME = re.compile(r"^(kept|slots)\.(\d+)$")


class KvpressUnavailable(RuntimeError):
    """No usable kvpress environment: the interpreter is unset, missing, or lacks kvpress 0.5.5."""


class KvpressWorkerError(RuntimeError):
    """The worker crashed, or its answer is malformed or inconsistent (its files are never trusted)."""


class KvpressTimeout(TimeoutError):
    """The worker gave no answer in time; its whole process group was ended."""


def install_commands(env: str = "~/kvpress-env") -> str:
    """How to create the environment. Pin transformers: with a newer one pip silently picks kvpress 0.5.2, which
    fails on it."""
    return (
        f"python -m venv {env} && {env}/bin/pip install torch==2.13.0 && "
        f"{env}/bin/pip install kvpress==0.5.5 'transformers==5.2.*' && export {ENV_VAR}={env}/bin/python"
    )


def find_kvpress_python(python: str | None = None) -> str:
    """The kvpress environment's interpreter: `python`, else $HYBRIDCACHE_KVPRESS_PYTHON."""
    python = python or os.environ.get(ENV_VAR)
    if not python:
        raise KvpressUnavailable(
            f"the kvpress reference needs {ENV_VAR}=<python of a kvpress environment>; "
            f"create one with: {install_commands()}"
        )
    path = Path(python).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise KvpressUnavailable(
            f"{ENV_VAR}={python} is not an executable interpreter; create one with: {install_commands()}"
        )
    return str(path)


@dataclass(frozen=True)
class KvpressResult:
    """One press on one context. `error` is set (and `nll` is None) when kvpress itself failed: a finding to
    report, e.g. "reference failed in the continuation: RuntimeError: ..."; `kept` then still holds what the
    prefill kept, if it got that far."""

    press: str
    kept: dict[int, torch.Tensor]  # layer -> [Hkv, n_kept] int64 original positions, ascending per head
    slots: dict[int, torch.Tensor]  # layer -> [Hkv, n_kept] the same positions in kvpress's cache-slot order
    nll: torch.Tensor | None  # [T_cont] float32
    meta: dict[str, Any] = field(default_factory=dict)
    context_len: int = 0
    error: str | None = None
    wall_s: float = 0.0  # the whole subprocess: interpreter start, imports, model load, both forwards

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def mean_nll(self) -> float:
        if self.nll is None:
            raise KvpressWorkerError(f"no NLL for press {self.press}: {self.error}")
        return float(self.nll.mean())

    @property
    def compressed_layers(self) -> list[int]:
        return sorted(i for i, k in self.kept.items() if k.shape[1] < self.context_len)


# request -> answer of this process's kvpress runs (two test suites ask kvpress the same questions)
_ANSWERED: dict[str, KvpressResult] = {}


def run_press(
    checkpoint_dir: str | Path,
    context_ids: Sequence[int] | torch.Tensor,
    continuation_ids: Sequence[int] | torch.Tensor,
    press: str = "snapkv",
    compression_ratio: float = 0.5,
    *,
    python: str | None = None,
    attn_implementation: str | None = None,
    dtype: str = "float32",
    feed: str = "one_forward",
    timeout: float = 900,
    threads: int | None = None,
    **press_kwargs: Any,
) -> KvpressResult:
    """Prefill `context_ids` (batch 1) under kvpress's `press` (our cache type name; extra keyword arguments such as
    window_size, kernel_size or n_sink go to the press), then score `continuation_ids` with position_ids continuing
    from the context, in one forward (feed="one_forward", as kvpress's pipeline feeds a question) or one token per
    forward (feed="per_token", as it decodes; pyramidkv runs only so: its layers' lengths differ and transformers
    5.2 sizes every layer's mask from layer 0, which sdpa skips for one token). attn_implementation defaults to
    eager where the press reads attention weights, else sdpa."""
    if press not in PRESS_NAMES:
        raise ValueError(f"unknown press {press!r} (known: {', '.join(PRESS_NAMES)})")
    if feed not in FEEDS:
        raise ValueError(f"feed must be one of {FEEDS}, not {feed!r}")
    interpreter = find_kvpress_python(python)
    context, continuation = _ids(context_ids, "context_ids"), _ids(continuation_ids, "continuation_ids")
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    if press != "none":
        press_kwargs = {"compression_ratio": float(compression_ratio), **press_kwargs}
    elif press_kwargs:
        raise ValueError(f"press 'none' takes no press arguments (got {sorted(press_kwargs)})")
    request = {
        "checkpoint": str(Path(checkpoint_dir).resolve()),
        "context_ids": context,
        "continuation_ids": continuation,
        "press": press,
        "press_kwargs": press_kwargs,
        "attn_implementation": attn_implementation,
        "dtype": dtype,
        "feed": feed,
        "threads": threads,
    }
    key = json.dumps({**request, "interpreter": interpreter}, sort_keys=True)
    if key in _ANSWERED:  # a kvpress run is deterministic: the same request in one process is answered once
        return copy.deepcopy(_ANSWERED[key])
    with tempfile.TemporaryDirectory(prefix="kvpress-") as tmp:
        req, ans, res = Path(tmp) / "request.json", Path(tmp) / "answer.json", Path(tmp) / "result.safetensors"
        req.write_text(json.dumps(request))
        started = time.perf_counter()
        try:
            code, stdout, stderr = run_worker(
                [interpreter, str(WORKER), str(req), str(ans), str(res)], timeout, Path(tmp), label="kvpress"
            )
        except TimeoutError as e:
            raise KvpressTimeout(str(e)) from None
        except OSError as e:  # the interpreter could not even start
            raise KvpressUnavailable(f"{interpreter} did not start ({e}); create one with: {install_commands()}") from e
        wall_s = time.perf_counter() - started
        if not ans.exists():
            raise KvpressWorkerError(f"the kvpress worker failed (exit {code}): {root_cause(stderr, stdout)}")
        result = read_answer(ans, res, press, len(context), len(continuation), config, wall_s)
    while len(_ANSWERED) >= 32:  # the oldest answers go first (dicts keep insertion order)
        del _ANSWERED[next(iter(_ANSWERED))]
    _ANSWERED[key] = copy.deepcopy(result)
    return result


def read_worker_files(answer_path: Path, result_path: Path) -> tuple[dict, Any, dict[str, torch.Tensor]]:
    """The worker's meta, its error (None: it answered) and its tensors, after the checks every kvpress request
    shares: an object with a 'meta' object, a refusal named (unavailable / refused), kvpress's version."""
    try:
        answer = json.loads(answer_path.read_text())
    except (OSError, ValueError) as e:
        raise KvpressWorkerError(f"the kvpress answer is not JSON: {e}") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("meta", {}), dict):
        raise KvpressWorkerError("the kvpress answer is not an object with a 'meta' object")
    meta, error = answer.get("meta", {}), answer.get("error")
    if error is not None:
        kind = answer.get("kind")
        if kind == "unavailable":
            raise KvpressUnavailable(f"{error}; create the environment with: {install_commands()}")
        if kind != "reference":
            raise KvpressWorkerError(f"the kvpress worker refused the request: {error}")
    check_version(meta)
    tensors = _load_tensors(result_path) if result_path.exists() else {}
    return meta, error, tensors


def read_answer(
    answer_path: Path,
    result_path: Path,
    press: str,
    context_len: int,
    continuation_len: int,
    config: dict,
    wall_s: float = 0.0,
) -> KvpressResult:
    """Parse and check the worker's files against what was asked (layer count and kv heads from our own read of
    config.json); anything off raises KvpressWorkerError."""
    meta, error, tensors = read_worker_files(answer_path, result_path)
    layers, heads = (
        int(config["num_hidden_layers"]),
        int(config.get("num_key_value_heads", config["num_attention_heads"])),
    )
    kept, slots = {}, {}
    for name, value in tensors.items():
        match = _TENSOR_NAME.match(name)
        if name == "nll":
            continue
        if match is None or int(match.group(2)) >= layers:
            raise KvpressWorkerError(f"unexpected tensor {name!r} in the kvpress result")
        (kept if match.group(1) == "kept" else slots)[int(match.group(2))] = value
    for layer, positions in kept.items():
        _check_positions(layer, positions, slots.get(layer), heads, context_len, meta)
    if set(slots) != set(kept):
        raise KvpressWorkerError("the kvpress result's kept and slot-order tensors name different layers")
    nll = None
    if error is None:
        nll = tensors.get("nll")
        if nll is None or nll.dtype != torch.float32 or tuple(nll.shape) != (continuation_len,):
            raise KvpressWorkerError(f"the kvpress NLL is missing or not float32 [{continuation_len}]")
        if not (torch.isfinite(nll).all() and (nll >= 0).all()):
            raise KvpressWorkerError("the kvpress NLL has non-finite or negative values")
        if not math.isclose(float(nll.mean()), float(meta.get("mean_nll", math.nan)), rel_tol=1e-5, abs_tol=1e-6):
            raise KvpressWorkerError("the kvpress meta's mean_nll disagrees with its NLL tensor")
        if press != "none" and sorted(kept) != sorted(int(i) for i in meta.get("hooked_layers", [])):
            raise KvpressWorkerError("the kvpress result lacks the kept positions of some compressed layer")
    return KvpressResult(
        press, dict(sorted(kept.items())), dict(sorted(slots.items())), nll, meta, context_len, error, wall_s
    )


def check_version(meta: dict) -> None:
    """The worker's kvpress must be the one our checks were written against."""
    version = (meta.get("versions") or {}).get("kvpress")
    if meta.get("versions") is not None and version not in SUPPORTED_KVPRESS:
        raise KvpressUnavailable(
            f"this environment has kvpress {version}, not {' or '.join(SUPPORTED_KVPRESS)}; "
            f"create one with: {install_commands()}"
        )


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if path.stat().st_size > MAX_RESULT_BYTES:
        raise KvpressWorkerError(f"the kvpress result is {path.stat().st_size} bytes, over {MAX_RESULT_BYTES}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise KvpressWorkerError(f"the kvpress result is not a valid safetensors file: {e}") from None


def _check_positions(
    layer: int, kept: torch.Tensor, slots: torch.Tensor | None, heads: int, context_len: int, meta: dict
) -> None:
    where = f"kvpress layer {layer}"
    if kept.dtype != torch.int64 or kept.dim() != 2 or kept.shape[0] != heads:
        raise KvpressWorkerError(
            f"{where}: kept positions must be int64 [{heads}, n_kept], not {kept.dtype} {list(kept.shape)}"
        )
    if kept.numel() and (kept.min() < 0 or kept.max() >= context_len or not (kept[:, 1:] > kept[:, :-1]).all()):
        raise KvpressWorkerError(f"{where}: kept positions must be distinct, ascending, in [0, {context_len})")
    if slots is None or slots.dtype != torch.int64 or not torch.equal(slots.sort(dim=-1).values, kept):
        raise KvpressWorkerError(f"{where}: the slot order is not a permutation of the kept positions")
    if (meta.get("n_kept") or {}).get(str(layer)) != kept.shape[1]:
        raise KvpressWorkerError(f"{where}: meta's n_kept disagrees with the kept positions")


def _ids(ids: Sequence[int] | torch.Tensor, what: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.dtype.is_floating_point:
            raise ValueError(f"{what} must be one row of token ids ([T] or [1, T]), not {ids.dtype} {list(ids.shape)}")
        ids = ids.tolist()
    out = [int(i) for i in ids]
    if not out or any(i < 0 for i in out):
        raise ValueError(f"{what} must be a non-empty list of non-negative token ids")
    return out
