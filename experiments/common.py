"""Shared set-up for experiments: checkpoint, tokenizer, model, cache config, reference runner, output dir."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import hybridcache as hc
from hybridcache.cache import available_layers, get_layer_class
from hybridcache.reference import FileRunner, HFRunner, ReferenceRunner, VLLMRunner
from hybridcache.tiny_models import FAMILIES, tiny_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype={name} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def checkpoint_path(model_cfg: DictConfig, home: str) -> str:
    """model.checkpoint, or the family's tiny random checkpoint (built once under `home`)."""
    if model_cfg.checkpoint:
        return str(model_cfg.checkpoint)
    if model_cfg.family not in FAMILIES:
        raise ValueError(f"model.family={model_cfg.family} has no tiny default; set model.checkpoint")
    os.environ["HYBRIDCACHE_HOME"] = str(Path(home).expanduser())
    return str(tiny_checkpoint(model_cfg.family, seed=int(model_cfg.seed), size=model_cfg.get("size", "tiny")))


def load_tokenizer(checkpoint: str):
    """The checkpoint's own tokenizer when it has one, else the offline byte-level ByT5 tokenizer."""
    import transformers

    if (Path(checkpoint) / "tokenizer_config.json").exists() or not Path(checkpoint).is_dir():
        try:
            return transformers.AutoTokenizer.from_pretrained(checkpoint)
        except Exception:  # noqa: BLE001 - fall back to bytes, which need no files
            pass
    return transformers.ByT5Tokenizer()


def tokenize(tokenizer, texts: list[str], vocab_size: int) -> list[list[int]]:
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    for text, ids in zip(texts, prompts):
        if not ids:
            raise ValueError(f"prompt {text!r} tokenizes to nothing")
        if max(ids) >= vocab_size:
            raise ValueError(f"the tokenizer produces id {max(ids)} >= the model's vocab_size {vocab_size}")
    return prompts


def _accepted(key: str, entry: dict) -> set[str]:
    """Parameters an entry's effective type takes: its own type, else its type name, else all of its kind."""
    if "type" in entry:
        return get_layer_class(entry["type"]).spec_cls.tunable_names()
    if key in ("attention", "recurrent"):
        return set.intersection(*(get_layer_class(t).spec_cls.tunable_names() for t in available_layers(key)))
    return get_layer_class(key).spec_cls.tunable_names() if key in available_layers() else set()


def cache_config_from_hydra(cache_cfg: DictConfig) -> tuple[dict[str, Any], bool]:
    """The cache-config mapping and whether to preallocate.

    Presets share one schema (type, window, chunk_size) so a sweep can override any field of any preset. A null
    value means unset (type null: the native types). A known parameter the entry's effective type does not take
    (chunk_size under type sliding) is dropped; unknown names stay, for resolve_plan to reject.
    """
    raw = OmegaConf.to_container(cache_cfg, resolve=True) if isinstance(cache_cfg, DictConfig) else dict(cache_cfg)
    preallocate = bool(raw.pop("preallocate", False))
    known = set().union(*(get_layer_class(t).spec_cls.tunable_names() for t in available_layers()))
    config: dict[str, Any] = {}
    for key, entry in raw.items():
        if not isinstance(entry, dict):
            config[key] = entry  # resolve_plan names the problem
            continue
        entry = {k: v for k, v in entry.items() if v is not None}
        if key == "layers":
            entry = {i: {k: v for k, v in e.items() if v is not None} if isinstance(e, dict) else e
                     for i, e in entry.items()}
        elif key in ("attention", "recurrent") or key in available_layers():
            accepted = _accepted(key, entry)
            entry = {k: v for k, v in entry.items() if k == "type" or k in accepted or k not in known}
        if entry:
            config[key] = entry
    return config, preallocate


def make_reference(ref_cfg: DictConfig, checkpoint: str, dtype: torch.dtype, device: str,
                   eos: int | None) -> ReferenceRunner | None:
    name = ref_cfg.name
    if name == "none":
        return None
    if name == "hf":
        return HFRunner(checkpoint, dtype, device, eos_token_id=eos)
    if name == "file":
        return FileRunner(ref_cfg.path)
    if name == "vllm":
        return VLLMRunner(ref_cfg.python, checkpoint, str(dtype).replace("torch.", ""), int(ref_cfg.max_model_len),
                          eos, float(ref_cfg.timeout), OmegaConf.to_container(ref_cfg.engine_args))
    raise ValueError(f"unknown reference '{name}' (known: hf, vllm, file, none)")


def load_model(cfg: DictConfig):
    checkpoint = checkpoint_path(cfg.model, cfg.home)
    model = hc.from_pretrained(checkpoint, dtype=dtype_of(cfg.model.dtype), device=cfg.model.device)
    return checkpoint, model
