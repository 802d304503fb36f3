"""Model families, chosen by the checkpoint's `model_type`. Each family is one file, imported when needed."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from hybridcache.models.base import HybridLM
from hybridcache.models.loading import load_weights, read_config, read_state_dict, resolve_checkpoint

# HF model_type -> "module:Class"
MODEL_TYPES = {
    "jamba": "hybridcache.models.jamba:JambaLM",
    "mamba": "hybridcache.models.mamba:MambaLM",
    "mamba2": "hybridcache.models.mamba2:Mamba2LM",
    "recurrent_gemma": "hybridcache.models.recurrentgemma:RecurrentGemmaLM",
    "gemma3_text": "hybridcache.models.gemma3:Gemma3LM",
    "llama4_text": "hybridcache.models.llama4:Llama4LM",
}


def model_class(model_type: str | None) -> type[HybridLM]:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODEL_TYPES))}")
    module, _, cls = MODEL_TYPES[model_type].partition(":")
    return getattr(importlib.import_module(module), cls)


def from_pretrained(
    path_or_hub_id: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> HybridLM:
    """Load a Hugging Face checkpoint (local directory, or hub id where reachable) into our implementation."""
    directory = resolve_checkpoint(path_or_hub_id)
    config = read_config(directory)
    model = model_class(config.get("model_type"))(config)
    load_weights(model, read_state_dict(directory))
    return model.to(device=device, dtype=dtype).eval()


__all__ = ["HybridLM", "MODEL_TYPES", "from_pretrained", "model_class"]
