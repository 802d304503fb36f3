"""Reading Hugging Face checkpoints: config.json, safetensors (sharded too), weights mapped by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from hybridcache.models.base import HybridLM

CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt"]


def resolve_checkpoint(path_or_id: str | Path) -> Path:
    """A local checkpoint directory, or a hub id downloaded (safetensors only) where the hub is reachable."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"{path} is a file; pass the checkpoint directory that holds config.json")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_id), allow_patterns=CHECKPOINT_FILES))
    except Exception as e:  # offline, unknown repo, no permission: one clear message
        raise FileNotFoundError(
            f"'{path_or_id}' is not a local directory and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def read_config(directory: Path) -> dict[str, Any]:
    file = directory / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{directory} has no config.json")
    return json.loads(file.read_text())


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            if not (directory / shard).exists():
                raise FileNotFoundError(f"{directory}: shard {shard} listed in {index.name} is missing")
            state.update(load_file(directory / shard))
        return state
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{directory} has no model.safetensors (or sharded index); only safetensors are read")
    return load_file(single)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_weights(model: HybridLM, state: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors into `model` by name; missing, unexpected or mis-shaped tensors are errors."""
    ours = model.state_dict()
    by_hf = {model.hf_name(name): name for name in ours}
    tied = {ours_name: emb for ours_name, emb in model.tied_weights.items()
            if model.config.get("tie_word_embeddings") and model.hf_name(ours_name) not in state}
    missing = [hf for hf, name in by_hf.items() if hf not in state and name not in tied]
    unexpected = [k for k in state if k not in by_hf]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors the {model.family} model needs: {_names(missing)}")
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} tensors the {model.family} model does not use: {_names(unexpected)}")
    converted = {}
    for hf, name in by_hf.items():
        if name in tied:
            continue
        tensor = state[hf]
        if tuple(tensor.shape) != tuple(ours[name].shape):
            raise ValueError(f"tensor {hf} has shape {tuple(tensor.shape)} in the checkpoint, the model expects {tuple(ours[name].shape)}")
        converted[name] = tensor
    model.load_state_dict(converted, strict=False)
    for name, emb in tied.items():  # share the embedding matrix as the output head
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, model.get_parameter(emb))
