"""LFM2 (Liquid AI): gated short causal convolutions and grouped-query attention with q/k norms, SwiGLU MLPs.

Each decoder layer is `h + operator(operator_norm(h))`, then `h + feed_forward(ffn_norm(h))`, where the operator is
either a short convolution (layer type "conv": in_proj -> B, C, x; y = C * conv(B * x); out_proj) or attention
(RoPE, per-head RMSNorm on q and k). The final norm is called `embedding_norm` in the checkpoint. A conv layer's
cache is the `conv` type: the last K-1 inputs B * x, [C, K-1] per row (K = conv_L_cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.family_config import FamilyConfig, attention_problems, length_problem, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput, residual_norm
from hybridcache.nn.attention.rotary import rope_frequencies
from hybridcache.nn.core.pre_norm import PreNormLayer, PreNormParts
from hybridcache.nn.recurrent.short_conv import ShortConv

LAYER_TYPES = ("conv", "full_attention")


@dataclass(kw_only=True)
class Lfm2Config(FamilyConfig):
    """HF Lfm2Config (transformers 5) fields the model reads, with HF defaults. `layer_types` wins over
    `full_attn_idxs` (attention layer indices; HF's default: every layer); `block_ff_dim` and `tie_embedding`
    are the original checkpoints' names of `intermediate_size` and `tie_word_embeddings`."""

    family: ClassVar[str] = "lfm2"
    tie_word_embeddings: bool = param(True, aliases=("tie_embedding",))
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    intermediate_size: int = param(12288, positive=True, aliases=("block_ff_dim",))
    num_attention_heads: int = param(32, positive=True)
    num_key_value_heads: int = param(8, positive=True)
    norm_eps: float = param(1e-5, positive=True)
    max_position_embeddings: int = param(128_000, positive=True)
    rope_parameters: dict | None = None
    rope_theta: float = param(1_000_000.0, positive=True)  # older configs, when rope_parameters is absent
    conv_bias: bool = False
    conv_L_cache: int = param(3, positive=True)
    block_multiple_of: int = param(256, positive=True)
    block_ffn_dim_multiplier: float = param(1.0, positive=True)
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: list[int] | None = param(None, nonnegative=True)
    layer_types: list[str] | None = param(None, choices=LAYER_TYPES)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            attn = set(range(self.num_hidden_layers) if self.full_attn_idxs is None else self.full_attn_idxs)
            self.layer_types = ["full_attention" if i in attn else "conv" for i in range(self.num_hidden_layers)]

    def problems(self) -> list[str]:
        out = attention_problems(self)
        bad = length_problem("layer_types", self.layer_types, self.num_hidden_layers)
        out += [bad] if bad else []
        if self.conv_L_cache < 2:
            out.append(f"conv_L_cache must be >= 2 (a causal conv of width 1 keeps no state), got {self.conv_L_cache}")
        return out

    @property
    def attn_head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def mlp_size(self) -> int:
        """The feed-forward width: intermediate_size, or with block_auto_adjust_ff_dim 2/3 of it times the
        multiplier, rounded up to a multiple of block_multiple_of (as HF)."""
        size = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            size = int(self.block_ffn_dim_multiplier * int(2 * size / 3))
            size = self.block_multiple_of * ((size + self.block_multiple_of - 1) // self.block_multiple_of)
        return size


class Lfm2DecoderLayer(PreNormLayer):
    def __init__(self, cfg: Lfm2Config, kind: str, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d, eps, hd = cfg.hidden_size, cfg.norm_eps, cfg.attn_head_dim
        self.kind = kind
        if kind == "conv":
            self.conv = ShortConv(d, cfg.conv_L_cache, cfg.conv_bias)
        else:  # HF names q_layernorm / k_layernorm / out_proj (and w1 / w3 / w2 for the MLP): Lfm2LM.hf_name
            self.self_attn = AttentionMixer(
                d,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                hd,
                rotary=rotary,
                q_norm=RMSNorm(hd, eps),
                k_norm=RMSNorm(hd, eps),
            )
        self.feed_forward = GatedMLP(d, cfg.mlp_size, "silu")
        self.operator_norm = RMSNorm(d, eps)
        self.ffn_norm = RMSNorm(d, eps)

    def pre_norm_parts(self) -> PreNormParts:
        mixer = self.conv if self.kind == "conv" else self.self_attn
        return PreNormParts(self.operator_norm, mixer, self.ffn_norm, self.feed_forward)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        operator = self.conv if self.kind == "conv" else self.self_attn
        h, x = residual_norm(h, operator(self.operator_norm(h), layer, step), None, self.ffn_norm)
        return h + self.feed_forward(x)


# Our AttentionMixer's and GatedMLP's names -> LFM2's.
_RENAMES = {
    ".self_attn.q_norm.": ".self_attn.q_layernorm.",
    ".self_attn.k_norm.": ".self_attn.k_layernorm.",
    ".self_attn.o_proj.": ".self_attn.out_proj.",
    ".feed_forward.gate_proj.": ".feed_forward.w1.",
    ".feed_forward.up_proj.": ".feed_forward.w3.",
    ".feed_forward.down_proj.": ".feed_forward.w2.",
}


@register_family("lfm2")
class Lfm2LM(StackLM):
    family = "lfm2"
    config_class = Lfm2Config

    final_norm_name = "embedding_norm"  # the final norm, despite its name

    def plan(self) -> list[str]:
        return list(self.cfg.layer_types)

    def shared(self) -> RotaryEmbedding:
        rope = self.cfg.rope_parameters or {"rope_type": "default", "rope_theta": self.cfg.rope_theta}
        return RotaryEmbedding(*rope_frequencies(self.cfg.to_dict(), rope, self.cfg.attn_head_dim))

    def build_layer(self, kind: str, index: int, shared: RotaryEmbedding) -> Lfm2DecoderLayer:
        return Lfm2DecoderLayer(self.cfg, kind, shared)

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.norm_eps)

    def hf_name(self, name: str) -> str:
        for ours, theirs in _RENAMES.items():
            name = name.replace(ours, theirs)
        return name

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        attn = {"num_kv_heads": c.num_key_value_heads, "head_dim": c.attn_head_dim, "dtype": self.dtype}
        conv = {"channels": c.hidden_size, "conv_kernel": c.conv_L_cache, "dtype": self.dtype}
        return [NativeLayer("conv", dict(conv)) if t == "conv" else NativeLayer("full", dict(attn)) for t in self.kinds]
