"""The reference system a run compares with (reference=hf | vllm | file | none): checked before any model is
loaded (`check_reference`, from config.json alone) and built (`make_reference`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.core.errors import UserError


def identity(cfg: DictConfig, prepared: Any) -> dict[str, Any]:
    """What a recording must share with a run that replays it."""
    return {
        "model_type": prepared.model_type,
        "weights": prepared.fingerprint,
        "dtype": str(cfg.model.dtype),
        "packed_weights": cfg.model.get("weights"),
        "max_new_tokens": int(cfg.max_new_tokens),
        "top_k": int(cfg.top_k),
        "eos_token_id": prepared.eos,
    }


def check_reference(cfg: DictConfig, prepared: Any) -> None:
    ref = cfg.reference
    if ref.name == "file":
        from hybridcache.reference import FileRunner, RecordingMismatch

        if ref.get("path") in (None, "", "???") or OmegaConf.is_missing(ref, "path"):
            raise UserError("reference=file needs reference.path=<a .jsonl written with +record=PATH.jsonl>")
        try:
            FileRunner(ref.path, expect=identity(cfg, prepared), prompts=prepared.prompts)
        except (FileNotFoundError, ValueError, RecordingMismatch) as e:
            raise UserError(str(e)) from None
    elif ref.name == "vllm":  # everything vLLM would refuse, from config.json, before anything is generated
        from hybridcache.reference.vllm_families import vllm_engine_args
        from hybridcache.reference.vllm_runner import find_interpreter

        try:
            python = find_interpreter(ref.get("python"))
            config = json.loads((Path(prepared.checkpoint) / "config.json").read_text())
            engine_args = OmegaConf.to_container(ref.engine_args) if ref.get("engine_args") else {}
            vllm_engine_args(config, str(cfg.model.dtype), engine_args, str(ref.get("platform", "auto")), python)
        except (ValueError, FileNotFoundError) as e:  # VLLMIncompatible is a ValueError
            raise UserError(str(e)) from None
    elif ref.name not in ("hf", "none"):
        raise unknown_reference(ref.name)


def make_reference(
    ref_cfg: DictConfig,
    checkpoint: str,
    dtype: torch.dtype,
    device: str,
    eos: int | None,
    expect: dict | None = None,
    prompts: list[list[int]] | None = None,
):
    from hybridcache.reference import FileRunner, HFRunner, VLLMRunner

    name = ref_cfg.name
    if name == "none":
        return None
    if name == "hf":
        return HFRunner(checkpoint, dtype, device, eos_token_id=eos)
    if name == "file":
        return FileRunner(ref_cfg.path, expect=expect, prompts=prompts)
    if name == "vllm":
        return VLLMRunner(
            ref_cfg.python,
            checkpoint,
            str(dtype).replace("torch.", ""),
            int(ref_cfg.max_model_len),
            eos,
            float(ref_cfg.timeout),
            OmegaConf.to_container(ref_cfg.engine_args),
            str(ref_cfg.get("platform", "auto")),
        )
    raise unknown_reference(name)


def unknown_reference(name: str) -> UserError:
    """The error for a reference this experiment cannot compare with (llama.cpp: a speed reference only)."""
    if name == "llamacpp":
        return UserError(
            "reference=llamacpp times the same GGUF in llama.cpp for experiment=benchmark only (its worker returns "
            "greedy tokens and timings, no logits); compare outputs with reference=hf, vllm or file"
        )
    return UserError(f"unknown reference '{name}' (known: hf, vllm, file, none)")
