"""Model families, chosen by the checkpoint's `model_type`. Each family is one module that registers itself
(`@register_family`, models/core/registry.py); in-tree ones are imported when needed, plugins through entry points."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridcache.accel import install as install_fast_path
from hybridcache.accel.huge_pages import collapse_module
from hybridcache.cache.core.limits import device_problem
from hybridcache.models.core.base import HybridLM
from hybridcache.models.core.family_config import ArgumentError, ConfigError, FamilyConfig, flag_problems
from hybridcache.models.core.loading import (
    CheckpointError,
    build_for_checkpoint,
    check_load_arguments,
    load_checkpoint,
    read_config,
    resolve_checkpoint,
)
from hybridcache.models.core.registry import BUILTIN, available_families, model_class, register_family
from hybridcache.nn.core.linear import WEIGHT_FORMATS, pack_weights, use_decode_linear

MODEL_TYPES = BUILTIN  # the in-tree families (model_type -> module); available_families() adds plugins


def from_pretrained(
    path_or_hub_id: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    allow_nonfinite: bool = False,
    allow_dtype_cast: bool = False,
    weights: str | None = None,
    decode_kernel: bool = True,
    huge_pages: bool = True,
) -> HybridLM:
    """Load a Hugging Face checkpoint (local directory, or hub id where reachable) into our implementation.

    The config is validated (ConfigError names every bad field), the model is built without allocating its
    weights, within what the checkpoint's headers hold (a config describing more is a ConfigError naming the
    fields), and checked against the checkpoint's tensor names and shapes and the memory there is (CheckpointError)
    before any tensor is read. Tensors with NaN/Inf values or of a non-float dtype where floats are expected are
    refused unless `allow_nonfinite` / `allow_dtype_cast`. Arguments are checked first (flags must be bools, the
    device must be usable here): an `ArgumentError` (a ConfigError) lists every bad one before anything is read.

    Speed (hybridcache/nn/core/linear.py): q/k/v and gate/up projections run as one matmul each; with
    `decode_kernel` every projection of a few float32 rows on CPU (a decode step) runs on a weight-streaming kernel
    (same math, float32 sums in another order). `weights="bfloat16"` or `"int8"` stores the projection matrices
    packed (2x / 4x fewer bytes to read per token; activations and sums stay float32): faster, but a different
    model, so it is opt-in; None keeps them in `dtype`. `huge_pages` moves the weights onto 2 MiB pages where Linux
    allows (hybridcache/accel/huge_pages.py: same memory, faster streaming; 1-2 s per GB once, at load).
    """
    check_load_arguments(dtype, device)
    problems = flag_problems(
        allow_nonfinite=allow_nonfinite,
        allow_dtype_cast=allow_dtype_cast,
        decode_kernel=decode_kernel,
        huge_pages=huge_pages,
    )
    problem = device_problem(device)
    if problems or problem:
        raise ArgumentError("from_pretrained", problems + ([problem] if problem else []))
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be None or one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if weights is not None and dtype != torch.float32:
        raise ValueError(
            f"weights={weights!r} packs float32 models (the decode kernel sums in float32); got dtype={dtype}"
        )
    directory = resolve_checkpoint(path_or_hub_id)
    config = read_config(directory)
    cls = model_class(config.get("model_type"))
    model = build_for_checkpoint(cls, config, directory, allow_dtype_cast)  # bounded by the checkpoint's headers
    load_checkpoint(model, directory, dtype, device, allow_nonfinite, allow_dtype_cast)
    model = model.to(device=device, dtype=dtype).eval()
    model.fuse_projections()
    model._projections_fused = True  # re-fused after later .to() calls
    if decode_kernel:
        use_decode_linear(model)
    if weights is not None:
        pack_weights(model, weights)
    install_fast_path(model)  # the CPU kernels' fast path (hybridcache/accel): same numbers as the modules' own
    model.huge_page_bytes = collapse_module(model) if huge_pages else 0
    return model


__all__ = [
    "ArgumentError",
    "CheckpointError",
    "ConfigError",
    "FamilyConfig",
    "HybridLM",
    "MODEL_TYPES",
    "available_families",
    "from_pretrained",
    "model_class",
    "register_family",
]
