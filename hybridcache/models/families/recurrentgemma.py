"""RecurrentGemma (Griffin): RG-LRU recurrent blocks and local (sliding-window) attention blocks, cycled.

Each residual block is temporal_pre_norm -> temporal_block (recurrent or attention) -> residual,
channel_pre_norm -> mlp_block -> residual. Embeddings are scaled by sqrt(hidden) rounded to bfloat16 (as HF's
`normalizer` buffer), logits are soft-capped.

Window: HF (transformers 5.x, masking_utils + DynamicSlidingWindowLayer) lets a query see the last
`attention_window_size` tokens including itself (kv > q - W), in prefill and in decoding alike, which is our
`sliding(window=W)` convention, so the native window is `attention_window_size` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import cycle, islice
from typing import ClassVar

import torch

from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields
from hybridcache.models.core.family_config import param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput
from hybridcache.nn.attention.rotary import rope_frequencies
from hybridcache.nn.core.pre_norm import PreNormLayer, PreNormParts
from hybridcache.nn.recurrent.rglru import RecurrentBlock


@dataclass(kw_only=True)
class RecurrentGemmaConfig(AttentionFields):
    """HF RecurrentGemmaConfig (transformers 5) fields the model reads, with HF defaults."""

    family: ClassVar[str] = "recurrentgemma"
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    intermediate_size: int = param(positive=True)
    num_attention_heads: int = param(positive=True)
    lru_width: int | None = param(None, positive=True)  # None: hidden_size
    attention_window_size: int = param(2048, positive=True, aliases=("sliding_window",))
    conv1d_width: int = param(4, positive=True)
    logits_soft_cap: float | None = param(30.0, nonnegative=True)
    hidden_activation: str = "gelu_pytorch_tanh"
    partial_rotary_factor: float = param(0.5, positive=True)
    block_types: list[str] = param(["recurrent", "recurrent", "attention"], choices=("recurrent", "attention"))

    def __post_init__(self) -> None:
        super().__post_init__()
        self.lru_width = self.lru_width or self.hidden_size

    def problems(self) -> list[str]:
        out = super().problems()
        if not self.block_types:
            out.append("block_types is empty")
        if self.lru_width % self.num_attention_heads:
            out.append(
                f"lru_width ({self.lru_width}) must be a multiple of num_attention_heads ({self.num_attention_heads})"
            )
        return out

    @property
    def types(self) -> list[str]:
        """ "recurrent" / "attention" for every layer: `block_types` repeated over num_hidden_layers."""
        return list(islice(cycle(self.block_types), self.num_hidden_layers))

    def rotary(self) -> RotaryEmbedding:
        """Partial rotary on the first head_dim * partial_rotary_factor features (default 0.5, as HF)."""
        params = dict(self.rope_parameters or {})
        params.setdefault("rope_type", "default")
        params.setdefault("rope_theta", self.rope_theta)
        dim = int(self.attention_head_dim * params.get("partial_rotary_factor", self.partial_rotary_factor))
        return RotaryEmbedding(*rope_frequencies(self.to_dict(), params, dim))


class RecurrentGemmaMLP(GatedMLP):
    """Gated MLP with biases and half the configured intermediate size (HF's RecurrentGemmaMlp)."""

    def __init__(self, cfg: RecurrentGemmaConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size // 2, cfg.hidden_activation, bias=True)


class RecurrentGemmaDecoderLayer(PreNormLayer):
    def __init__(self, cfg: RecurrentGemmaConfig, kind: str, rope: RotaryEmbedding) -> None:
        super().__init__()
        d, eps, heads = cfg.hidden_size, cfg.rms_norm_eps, cfg.num_attention_heads
        self.kind = kind
        self.temporal_pre_norm = RMSNorm(d, eps, unit_offset=True)
        if kind == "attention":
            hd = cfg.attention_head_dim
            self.temporal_block = AttentionMixer(
                d,
                heads,
                cfg.num_key_value_heads,
                hd,
                qkv_bias=cfg.attention_bias,
                o_bias=True,
                scale=hd**-0.5,
                rotary=rope,
            )
        else:
            self.temporal_block = RecurrentBlock(d, cfg.lru_width, heads, cfg.conv1d_width, cfg.hidden_activation)
        self.channel_pre_norm = RMSNorm(d, eps, unit_offset=True)
        self.mlp_block = RecurrentGemmaMLP(cfg)

    def pre_norm_parts(self) -> PreNormParts:
        return PreNormParts(self.temporal_pre_norm, self.temporal_block, self.channel_pre_norm, self.mlp_block)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        h = h + self.temporal_block(self.temporal_pre_norm(h), layer, step)
        return h + self.mlp_block(self.channel_pre_norm(h))


@register_family("recurrent_gemma")
class RecurrentGemmaLM(StackLM):
    family = "recurrentgemma"
    config_class = RecurrentGemmaConfig
    final_norm_name = "final_norm"

    def plan(self) -> list[str]:
        return self.cfg.types

    def shared(self) -> RotaryEmbedding:
        return self.cfg.rotary()

    def build_layer(self, kind: str, index: int, shared: RotaryEmbedding) -> RecurrentGemmaDecoderLayer:
        return RecurrentGemmaDecoderLayer(self.cfg, kind, shared)

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps, unit_offset=True)

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        attn = NativeLayer(
            "sliding",
            {
                "num_kv_heads": c.num_key_value_heads,
                "head_dim": c.attention_head_dim,
                "dtype": self.dtype,
                "window": c.attention_window_size,  # W visible incl. current (as HF)
            },
        )
        lru = NativeLayer("rglru", {"lru_width": c.lru_width, "conv_kernel": c.conv1d_width, "dtype": self.dtype})
        return [attn if t == "attention" else lru for t in self.types]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # [B, T, D]
        normalizer = torch.tensor(self.cfg.hidden_size**0.5, dtype=torch.bfloat16)  # HF rounds it to bf16
        return h * normalizer.to(device=h.device, dtype=h.dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().head(h)
        cap = self.cfg.logits_soft_cap
        return cap * torch.tanh(logits / cap) if cap else logits
