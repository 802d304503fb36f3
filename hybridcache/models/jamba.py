"""Jamba: interleaved Mamba (with dt/B/C norms) and attention layers without positional embeddings, MoE MLPs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hybridcache.blocks import AttentionMixer, GatedMLP, RMSNorm, StepInput, residual_norm
from hybridcache.blocks.mamba import MambaMixer, resolve_dt_rank
from hybridcache.blocks.moe import SparseMoE
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.base import HybridLM
from hybridcache.models.family_config import FamilyConfig, attention_problems, length_problem, param
from hybridcache.models.registry import register_family


@dataclass(kw_only=True)
class JambaConfig(FamilyConfig):
    """HF JambaConfig (transformers 5) fields the model reads, with HF defaults; `num_local_experts` is an alias."""

    family: ClassVar[str] = "jamba"
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    intermediate_size: int = param(positive=True)
    num_attention_heads: int = param(positive=True)
    num_key_value_heads: int | None = param(8, positive=True)  # None: num_attention_heads
    head_dim: int | None = param(None, positive=True)  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = param(1e-6, positive=True)
    attn_layer_period: int = param(8, positive=True)
    attn_layer_offset: int = param(4, nonnegative=True)
    expert_layer_period: int = param(2, positive=True)
    expert_layer_offset: int = param(1, nonnegative=True)
    num_experts: int = param(16, positive=True, aliases=("num_local_experts",))
    num_experts_per_tok: int = param(2, positive=True)
    mamba_d_state: int = param(16, positive=True)
    mamba_d_conv: int = param(4, positive=True)
    mamba_expand: int = param(2, positive=True)
    mamba_dt_rank: int | str = param("auto", positive=True)  # "auto": ceil(hidden_size / 16)
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    layers_block_type: list[str] | None = param(None, choices=("attention", "mamba"))  # else period/offset
    layers_num_experts: list[int] | None = param(None, positive=True)  # else expert period/offset

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    def problems(self) -> list[str]:
        out = attention_problems(self)
        if self.attn_layer_offset >= self.attn_layer_period:
            out.append(
                f"attn_layer_offset ({self.attn_layer_offset}) must be < attn_layer_period ({self.attn_layer_period})"
            )
        if self.expert_layer_offset >= self.expert_layer_period:
            out.append(
                f"expert_layer_offset ({self.expert_layer_offset}) must be < expert_layer_period "
                f"({self.expert_layer_period})"
            )
        if self.num_experts_per_tok > self.num_experts:
            out.append(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
        if isinstance(self.mamba_dt_rank, str) and self.mamba_dt_rank != "auto":
            out.append(f"mamba_dt_rank must be a positive int or 'auto', got {self.mamba_dt_rank!r}")
        for name in ("layers_block_type", "layers_num_experts"):
            bad = length_problem(name, getattr(self, name), self.num_hidden_layers)
            out += [bad] if bad else []
        return out


def block_types(config: dict) -> list[str]:
    """ "attention" or "mamba" per layer: `layers_block_type` if given, else from attn_layer_period/offset."""
    if config.get("layers_block_type"):
        types = list(config["layers_block_type"])
    else:
        period, offset = config["attn_layer_period"], config["attn_layer_offset"]
        types = ["attention" if i % period == offset else "mamba" for i in range(config["num_hidden_layers"])]
    unknown = set(types) - {"attention", "mamba"}
    if unknown or len(types) != config["num_hidden_layers"]:
        raise ValueError(f"jamba: bad layer types {types} for {config['num_hidden_layers']} layers")
    return types


def experts_per_layer(config: dict) -> list[int]:
    """Number of experts per layer (1 = dense MLP): `layers_num_experts` if given, else expert period/offset."""
    if config.get("layers_num_experts"):
        return [int(n) for n in config["layers_num_experts"]]
    period, offset, n = config["expert_layer_period"], config["expert_layer_offset"], config["num_experts"]
    return [n if i % period == offset else 1 for i in range(config["num_hidden_layers"])]


def head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


class JambaDecoderLayer(nn.Module):
    """h + mixer(input_layernorm(h)), then h + feed_forward(pre_ff_layernorm(h)); mixer = self_attn or mamba."""

    def __init__(self, config: dict, kind: str, num_experts: int) -> None:
        super().__init__()
        d, eps, act = config["hidden_size"], config["rms_norm_eps"], config["hidden_act"]
        if kind == "attention":
            self.self_attn = AttentionMixer(
                d, config["num_attention_heads"], config["num_key_value_heads"], head_dim(config)
            )  # no rotary: Jamba has no positional embeddings
        else:
            self.mamba = MambaMixer(
                d,
                config["mamba_expand"] * d,
                config["mamba_d_state"],
                config["mamba_d_conv"],
                resolve_dt_rank(config["mamba_dt_rank"], d),
                conv_bias=config["mamba_conv_bias"],
                proj_bias=config["mamba_proj_bias"],
                activation=act,
                inner_norms=True,
                norm_eps=eps,
            )
        if num_experts > 1:
            self.feed_forward = SparseMoE(
                d, config["intermediate_size"], num_experts, config["num_experts_per_tok"], act
            )
        else:
            self.feed_forward = GatedMLP(d, config["intermediate_size"], act)
        self.input_layernorm = RMSNorm(d, eps)
        self.pre_ff_layernorm = RMSNorm(d, eps)
        self.kind = kind

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        mixer = self.self_attn if self.kind == "attention" else self.mamba
        h, x = residual_norm(h, mixer(self.input_layernorm(h), layer, step), None, self.pre_ff_layernorm)
        return h + self.feed_forward(x)


class JambaInner(nn.Module):
    def __init__(self, config: dict, types: list[str]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(
            JambaDecoderLayer(config, kind, n) for kind, n in zip(types, experts_per_layer(config), strict=True)
        )
        self.final_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])


@register_family("jamba")
class JambaLM(HybridLM):
    family = "jamba"
    config_class = JambaConfig
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Mapping[str, Any] | JambaConfig) -> None:
        cfg = self.config_class.from_hf(config)
        super().__init__(cfg.to_dict())
        self.cfg = cfg
        self.types = block_types(self.config)
        self.model = JambaInner(self.config, self.types)
        self.lm_head = nn.Linear(self.config["hidden_size"], self.config["vocab_size"], bias=False)

    def native_layers(self) -> list[NativeLayer]:
        c = self.config
        attn = {"num_kv_heads": c["num_key_value_heads"], "head_dim": head_dim(c), "dtype": self.dtype}
        mamba = {
            "intermediate_size": c["mamba_expand"] * c["hidden_size"],
            "state_size": c["mamba_d_state"],
            "conv_kernel": c["mamba_d_conv"],
            "dtype": self.dtype,
        }
        return [NativeLayer("full", attn) if t == "attention" else NativeLayer("mamba", mamba) for t in self.types]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.final_layernorm(h))  # [B, T, V]
