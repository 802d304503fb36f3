"""engine=hf set-up shared by the experiments that run HF transformers' own modeling code with our cache
(hybridcache.hf.cache_for): the checkpoint (any HF causal LM, families hybridcache does not implement included), the
settings checked before loading, the model and the plans.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from experiments.core.common import UserError, check_device, dtype_of, oracle_tolerance, quiet_libraries


def hf_checkpoint(cfg: DictConfig) -> tuple[str, dict[str, Any], str]:
    """(local directory, config.json, what it is): model.checkpoint, or the family's tiny default (saved in HF's
    format, so HF loads it too). A checkpoint HF cannot run as a causal LM is a UserError."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from experiments.core.common import checkpoint_path, describe_checkpoint
    from hybridcache.models.core.loading import resolve_checkpoint

    try:
        directory = str(resolve_checkpoint(checkpoint_path(cfg.model, cfg.home)))
        config = json.loads((Path(directory) / "config.json").read_text())
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"model: {e}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"model.checkpoint: model_type {model_type!r} is not a causal LM HF transformers can run (engine=hf)"
        )
    return directory, config, describe_checkpoint(cfg.model, directory)


def check_hf_settings(cfg: DictConfig, prompts: bool = True) -> dict[str, Any]:
    """Every setting engine=hf takes, before the model is loaded; a UserError is one line."""
    from experiments.core.cache_config import cache_config_with_notes
    from hybridcache.cache import CacheError

    quiet_libraries()
    dtype = dtype_of(str(cfg.model.dtype))
    check_device(str(cfg.model.device))
    if cfg.model.get("weights") is not None:
        raise UserError("model.weights packs our own projections; engine=hf runs HF's modules as they are (null)")
    if prompts and cfg.reference.name not in ("hf", "none"):
        raise UserError(
            f"reference={cfg.reference.name}: engine=hf compares with HF's own cache on the same model "
            "(reference=hf, the default) or with nothing (reference=none)"
        )
    if prompts and (cfg.get("prefill_chunk_size") is not None or cfg.generation.compile or cfg.get("record")):
        raise UserError("engine=hf takes no prefill_chunk_size, generation.compile or +record (engine=ours does)")
    try:
        cache_config, preallocate, notes = cache_config_with_notes(cfg.cache)
    except CacheError as e:
        raise UserError(str(e)) from None
    if preallocate:  # the app sizes it from the prompts for our models; through the bridge a size is given
        raise UserError(
            "cache.preallocate=true is engine=ours' (sized from the prompts); with engine=hf give the size: "
            "cache.attention.max_length=N"
        )
    texts = list(cfg.prompts.texts)
    if prompts and not texts:
        raise UserError("prompts.texts is empty")
    directory, config, note = hf_checkpoint(cfg)
    return {
        "dtype": dtype,
        "cache_config": cache_config,
        "notes": notes,
        "texts": texts,
        "checkpoint": directory,
        "checkpoint_note": note,
        "model_type": config.get("model_type"),
        "tolerance": oracle_tolerance(cfg, dtype),
    }


def load_hf_model(prep: dict[str, Any], device: str):
    """HF transformers' own model of the checkpoint, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(prep["checkpoint"], dtype=prep["dtype"]).to(device)
    return model.eval()


def hf_plans(model, cache_config: dict[str, Any]):
    """(plan, native plan) of `model` under `cache_config` through the bridge; a config it cannot take is one line."""
    from hybridcache.hf import BridgeError, plan_for

    try:
        return plan_for(model, cache_config)[2], plan_for(model)[2]
    except (BridgeError, ValueError) as e:  # CacheError, BridgeConfigError
        raise UserError(str(e)) from None
