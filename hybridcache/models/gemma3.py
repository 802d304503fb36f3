"""Gemma3 text model: sliding-window and full attention layers, sandwich norms, q/k norms, scaled embeddings."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hybridcache.blocks import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput, residual_norm
from hybridcache.blocks.rotary import rope_frequencies
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.base import HybridLM
from hybridcache.models.family_config import FamilyConfig, attention_problems, length_problem, param
from hybridcache.models.registry import register_family

NATIVE_TYPE = {"sliding_attention": "sliding", "full_attention": "full"}


@dataclass(kw_only=True)
class Gemma3Config(FamilyConfig):
    """HF Gemma3TextConfig (transformers 5) fields the model reads, with HF defaults. `rope_theta` and
    `rope_local_base_freq` (older configs) apply to full / sliding layers when `rope_parameters` is absent."""

    family: ClassVar[str] = "gemma3"
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    intermediate_size: int = param(positive=True)
    num_attention_heads: int = param(positive=True)
    num_key_value_heads: int = param(4, positive=True)
    head_dim: int = param(256, positive=True)
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = param(1e-6, positive=True)
    max_position_embeddings: int = param(131_072, positive=True)
    rope_parameters: dict | None = None
    rope_theta: float = param(1_000_000.0, positive=True)
    rope_local_base_freq: float = param(10_000.0, positive=True)
    attention_bias: bool = False
    query_pre_attn_scalar: int | float = param(256, positive=True)
    sliding_window: int | None = param(4096, positive=True)
    sliding_window_pattern: int = param(6, positive=True, aliases=("_sliding_window_pattern",))
    layer_types: list[str] | None = param(None, choices=tuple(NATIVE_TYPE))  # else from sliding_window_pattern
    final_logit_softcapping: float | None = param(None, nonnegative=True)
    attn_logit_softcapping: float | None = param(None, nonnegative=True)

    def problems(self) -> list[str]:
        out = attention_problems(self)
        bad = length_problem("layer_types", self.layer_types, self.num_hidden_layers)
        out += [bad] if bad else []
        if self.sliding_window is None and "sliding_attention" in layer_types(self.to_dict()):
            out.append("sliding_window is null but there are sliding_attention layers")
        return out


def layer_types(config: dict) -> list[str]:
    if "layer_types" in config and config["layer_types"]:
        return list(config["layer_types"])
    pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(config["num_hidden_layers"])
    ]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: dict, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d, eps, head_dim = config["hidden_size"], config.get("rms_norm_eps", 1e-6), config["head_dim"]
        self.self_attn = AttentionMixer(
            d,
            config["num_attention_heads"],
            config["num_key_value_heads"],
            head_dim,
            qkv_bias=config.get("attention_bias", False),
            o_bias=config.get("attention_bias", False),
            scale=config["query_pre_attn_scalar"] ** -0.5,
            softcap=config.get("attn_logit_softcapping"),
            rotary=rotary,
            q_norm=RMSNorm(head_dim, eps, unit_offset=True),
            k_norm=RMSNorm(head_dim, eps, unit_offset=True),
        )
        self.mlp = GatedMLP(d, config["intermediate_size"], config.get("hidden_activation", "gelu_pytorch_tanh"))
        self.input_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        a = self.self_attn(self.input_layernorm(h), layer, step)
        h, x = residual_norm(h, a, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        return residual_norm(h, self.mlp(x), self.post_feedforward_layernorm, None)[0]


class Gemma3Inner(nn.Module):
    def __init__(self, config: dict, types: list[str]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        rope = config.get("rope_parameters") or {}
        rotary = {}
        for kind in set(types):
            params = rope.get(kind) or {
                "rope_type": "default",
                "rope_theta": config.get(
                    "rope_local_base_freq" if kind == "sliding_attention" else "rope_theta", 10000.0
                ),
            }
            rotary[kind] = RotaryEmbedding(*rope_frequencies(config, params, config["head_dim"]))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, rotary[t]) for t in types)
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6), unit_offset=True)


@register_family("gemma3_text")
class Gemma3LM(HybridLM):
    family = "gemma3"
    config_class = Gemma3Config
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Mapping[str, Any] | Gemma3Config) -> None:
        cfg = self.config_class.from_hf(config)
        super().__init__(cfg.to_dict())
        self.cfg = cfg
        self.types = layer_types(self.config)
        self.model = Gemma3Inner(self.config, self.types)
        self.lm_head = nn.Linear(self.config["hidden_size"], self.config["vocab_size"], bias=False)

    def native_layers(self) -> list[NativeLayer]:
        c = self.config
        attn = {"num_kv_heads": c["num_key_value_heads"], "head_dim": c["head_dim"], "dtype": self.dtype}
        # only the sliding layers have a window: a type that takes one (sink, a score-based method over a window)
        # must not inherit it on a global layer
        return [
            NativeLayer(
                NATIVE_TYPE[t], {**attn, "window": c["sliding_window"]} if NATIVE_TYPE[t] == "sliding" else dict(attn)
            )
            for t in self.types
        ]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(math.sqrt(self.config["hidden_size"]), dtype=h.dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(h))
        cap = self.config.get("final_logit_softcapping")
        return cap * torch.tanh(logits / cap) if cap else logits
