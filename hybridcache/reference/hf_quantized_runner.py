"""Runs hf_quantized_worker.py in the environment named by `HYBRIDCACHE_HFQ_PYTHON` (transformers 5.2 + quanto).

Our process runs a newer transformers that refuses QuantizedCache for models with sliding layers, and the two must
never share a process: tensors go over safetensors files, the worker is a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

WORKER = Path(__file__).with_name("hf_quantized_worker.py")
INSTALL = (
    "python -m venv /work/hfq-env && /work/hfq-env/bin/pip install torch==2.13.0 && "
    "/work/hfq-env/bin/pip install 'transformers==5.2.*' optimum-quanto safetensors ninja; "
    "export HYBRIDCACHE_HFQ_PYTHON=/work/hfq-env/bin/python"
)


class HFQuantizedUnavailable(RuntimeError):
    """No transformers 5.2 + optimum-quanto environment is configured."""


class HFQuantizedWorkerError(RuntimeError):
    """The reference worker failed (its stderr's tail is in the message)."""


def hfq_python() -> str:
    path = os.environ.get("HYBRIDCACHE_HFQ_PYTHON")
    if not path:
        raise HFQuantizedUnavailable(
            f"set HYBRIDCACHE_HFQ_PYTHON to a python with transformers 5.2 and optimum-quanto, e.g.: {INSTALL}"
        )
    if not Path(path).exists():
        raise HFQuantizedUnavailable(f"HYBRIDCACHE_HFQ_PYTHON={path} does not exist; build it with: {INSTALL}")
    return path


def _run_worker(python: str, tensors: dict[str, torch.Tensor], request: dict, timeout: float) -> dict:
    """One worker call: `tensors` and the `request` in over a safetensors file, the worker's tensors out; checks that
    the worker ran transformers 5.2."""
    with tempfile.TemporaryDirectory(prefix="hfq-") as tmp:
        src, dst = Path(tmp, "in.safetensors"), Path(tmp, "out.safetensors")
        save_file(tensors, src, metadata={"request": json.dumps(request)})
        proc = subprocess.run(
            [python, str(WORKER), str(src), str(dst)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONPATH": ""},
        )
        if proc.returncode != 0:
            raise HFQuantizedWorkerError(f"hf_quantized worker failed ({proc.returncode}): {proc.stderr[-3000:]}")
        with safe_open(dst, framework="pt") as f:
            version = f.metadata().get("transformers", "?")
        out = load_file(dst)
    if not version.startswith("5.2."):
        raise HFQuantizedUnavailable(f"{python} has transformers {version}; the reference is 5.2: {INSTALL}")
    return out


def run_hf_quantized(
    keys: torch.Tensor,
    values: torch.Tensor,
    splits: list[int],
    *,
    nbits: int = 4,
    axis_key: int = 0,
    axis_value: int = 0,
    q_group_size: int = 64,
    residual_length: int = 128,
    timeout: float = 600.0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Feed keys, values [B, H, N, D] through HF 5.2's QuantoQuantizedLayer in blocks of `splits` tokens; returns
    (keys, values) the attention sees for each block."""
    if sum(splits) != keys.shape[2] or min(splits) <= 0:
        raise ValueError(f"splits {splits} must be positive and sum to {keys.shape[2]} tokens")
    python = hfq_python()
    request = dict(
        splits=list(splits),
        nbits=nbits,
        axis_key=axis_key,
        axis_value=axis_value,
        q_group_size=q_group_size,
        residual_length=residual_length,
    )
    tensors = {"keys": keys.detach().cpu().contiguous(), "values": values.detach().cpu().contiguous()}
    out = _run_worker(python, tensors, request, timeout)
    return [(out[f"keys.{i}"], out[f"values.{i}"]) for i in range(len(splits))]


def run_hf_quantized_model(
    checkpoint: str | os.PathLike,
    prompt_ids: torch.Tensor,
    cont_ids: torch.Tensor,
    *,
    nbits: int | None = 4,
    axis_key: int = 0,
    axis_value: int = 0,
    q_group_size: int = 64,
    residual_length: int = 128,
    timeout: float = 900.0,
) -> torch.Tensor:
    """HF 5.2's model on a HF-format `checkpoint` (float32, CPU, eager): prefill `prompt_ids` [1, P] into a
    QuantizedCache(quanto) (nbits None: a DynamicCache), then `cont_ids` [1, T] in one forward. Returns the logits
    [T, V] predicting each continuation token (the prompt's last, then the continuation's but its last)."""
    python = hfq_python()
    request = dict(
        mode="model",
        checkpoint=str(checkpoint),
        nbits=nbits,
        axis_key=axis_key,
        axis_value=axis_value,
        q_group_size=q_group_size,
        residual_length=residual_length,
    )
    tensors = {"prompt_ids": prompt_ids.long().contiguous(), "cont_ids": cont_ids.long().contiguous()}
    return _run_worker(python, tensors, request, timeout)["logits"]
