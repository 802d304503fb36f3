"""RecurrentGemma (Griffin): RG-LRU recurrent blocks and local (sliding-window) attention blocks, cycled.

Each residual block is temporal_pre_norm -> temporal_block (recurrent or attention) -> residual,
channel_pre_norm -> mlp_block -> residual. Embeddings are scaled by sqrt(hidden) rounded to bfloat16 (as HF's
`normalizer` buffer), logits are soft-capped.

Window: HF (transformers 5.x, masking_utils + DynamicSlidingWindowLayer) lets a query see the last
`attention_window_size` tokens including itself (kv > q - W), in prefill and in decoding alike, which is our
`sliding(window=W)` convention, so the native window is `attention_window_size` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import cycle, islice
from typing import Any, ClassVar

import torch
from torch import nn

from hybridcache.blocks import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput
from hybridcache.blocks.rglru import RecurrentBlock
from hybridcache.blocks.rotary import rope_frequencies
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.base import HybridLM
from hybridcache.models.family_config import FamilyConfig, attention_problems, param
from hybridcache.models.registry import register_family


@dataclass(kw_only=True)
class RecurrentGemmaConfig(FamilyConfig):
    """HF RecurrentGemmaConfig (transformers 5) fields the model reads, with HF defaults."""

    family: ClassVar[str] = "recurrentgemma"
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    intermediate_size: int = param(positive=True)
    num_attention_heads: int = param(positive=True)
    num_key_value_heads: int | None = param(None, positive=True)  # None: num_attention_heads
    head_dim: int | None = param(None, positive=True)  # None: hidden_size // num_attention_heads
    lru_width: int | None = param(None, positive=True)  # None: hidden_size
    attention_window_size: int = param(2048, positive=True, aliases=("sliding_window",))
    conv1d_width: int = param(4, positive=True)
    logits_soft_cap: float | None = param(30.0, nonnegative=True)
    rms_norm_eps: float = param(1e-6, positive=True)
    hidden_activation: str = "gelu_pytorch_tanh"
    rope_parameters: dict | None = None
    rope_theta: float = param(10_000.0, positive=True)
    partial_rotary_factor: float = param(0.5, positive=True)
    block_types: list[str] = param(["recurrent", "recurrent", "attention"], choices=("recurrent", "attention"))
    attention_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.lru_width = self.lru_width or self.hidden_size

    def problems(self) -> list[str]:
        out = attention_problems(self)
        if not self.block_types:
            out.append("block_types is empty")
        if self.lru_width % self.num_attention_heads:
            out.append(
                f"lru_width ({self.lru_width}) must be a multiple of num_attention_heads ({self.num_attention_heads})"
            )
        return out


def block_types(config: dict) -> list[str]:
    """ "recurrent" / "attention" for every layer: `block_types` repeated over num_hidden_layers."""
    types = list(config.get("block_types") or ("recurrent", "recurrent", "attention"))
    out = list(islice(cycle(types), config["num_hidden_layers"]))
    unknown = set(out) - {"recurrent", "attention"}
    if unknown:
        raise ValueError(f"unsupported RecurrentGemma block types {sorted(unknown)} (supported: recurrent, attention)")
    return out


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def rotary(config: dict) -> RotaryEmbedding:
    """Partial rotary on the first head_dim * partial_rotary_factor features (default 0.5, as HF)."""
    params = dict(config.get("rope_parameters") or {})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    dim = int(head_dim(config) * factor)
    return RotaryEmbedding(*rope_frequencies(config, params, dim))


class RecurrentGemmaMLP(GatedMLP):
    """Gated MLP with biases and half the configured intermediate size (HF's RecurrentGemmaMlp)."""

    def __init__(self, config: dict) -> None:
        super().__init__(
            config["hidden_size"],
            config["intermediate_size"] // 2,
            config.get("hidden_activation", "gelu_pytorch_tanh"),
            bias=True,
        )


class RecurrentGemmaDecoderLayer(nn.Module):
    def __init__(self, config: dict, kind: str, rope: RotaryEmbedding) -> None:
        super().__init__()
        d, eps, heads = config["hidden_size"], config.get("rms_norm_eps", 1e-6), config["num_attention_heads"]
        self.kind = kind
        self.temporal_pre_norm = RMSNorm(d, eps, unit_offset=True)
        if kind == "attention":
            hd = head_dim(config)
            self.temporal_block = AttentionMixer(
                d,
                heads,
                config.get("num_key_value_heads") or heads,
                hd,
                qkv_bias=config.get("attention_bias", False),
                o_bias=True,
                scale=hd**-0.5,
                rotary=rope,
            )
        else:
            self.temporal_block = RecurrentBlock(
                d,
                config.get("lru_width") or d,
                heads,
                config.get("conv1d_width", 4),
                config.get("hidden_activation", "gelu_pytorch_tanh"),
            )
        self.channel_pre_norm = RMSNorm(d, eps, unit_offset=True)
        self.mlp_block = RecurrentGemmaMLP(config)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        h = h + self.temporal_block(self.temporal_pre_norm(h), layer, step)
        return h + self.mlp_block(self.channel_pre_norm(h))


class RecurrentGemmaInner(nn.Module):
    def __init__(self, config: dict, types: list[str]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        rope = rotary(config)
        self.layers = nn.ModuleList(RecurrentGemmaDecoderLayer(config, t, rope) for t in types)
        self.final_norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6), unit_offset=True)


@register_family("recurrent_gemma")
class RecurrentGemmaLM(HybridLM):
    family = "recurrentgemma"
    config_class = RecurrentGemmaConfig
    tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Mapping[str, Any] | RecurrentGemmaConfig) -> None:
        cfg = self.config_class.from_hf(config)
        super().__init__(cfg.to_dict())
        self.cfg = cfg
        self.types = block_types(self.config)
        self.model = RecurrentGemmaInner(self.config, self.types)
        self.lm_head = nn.Linear(self.config["hidden_size"], self.config["vocab_size"], bias=False)

    def native_layers(self) -> list[NativeLayer]:
        c = self.config
        attn = NativeLayer(
            "sliding",
            {
                "num_kv_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
                "head_dim": head_dim(c),
                "dtype": self.dtype,
                "window": c.get("attention_window_size", 2048),  # W visible incl. current (as HF)
            },
        )
        lru = NativeLayer(
            "rglru",
            {
                "lru_width": c.get("lru_width") or c["hidden_size"],
                "conv_kernel": c.get("conv1d_width", 4),
                "dtype": self.dtype,
            },
        )
        return [attn if t == "attention" else lru for t in self.types]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # [B, T, D]
        normalizer = torch.tensor(self.config["hidden_size"] ** 0.5, dtype=torch.bfloat16)  # HF rounds it to bf16
        return h * normalizer.to(device=h.device, dtype=h.dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.final_norm(h))
        cap = self.config.get("logits_soft_cap")
        return cap * torch.tanh(logits / cap) if cap else logits
