"""Qwen3-Next: Gated DeltaNet linear-attention layers and gated full-attention layers (output gate, partial RoPE,
(1 + w) q/k norms), sparse MoE feed-forwards with a gated shared expert (dense MLPs on `mlp_only_layers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields
from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput, residual_norm
from hybridcache.nn.core.pre_norm import PreNormLayer, PreNormParts
from hybridcache.nn.moe.shared import SharedExpertMoE
from hybridcache.nn.recurrent.gated_deltanet import GatedDeltaNetMixer

LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(kw_only=True)
class Qwen3NextConfig(AttentionFields):
    """HF Qwen3NextConfig (transformers 5) fields the model reads, with HF defaults. Older configs' `rope_theta`,
    `partial_rotary_factor` and `rope_scaling` are read when `rope_parameters` is absent (`rope()`), and
    `full_attention_interval` when `layer_types` is."""

    family: ClassVar[str] = "qwen3_next"
    intermediate_size: int = param(5632, positive=True)
    num_attention_heads: int = param(16, positive=True)
    num_key_value_heads: int = param(2, positive=True)
    head_dim: int = param(256, positive=True)
    hidden_act: str = "silu"
    max_position_embeddings: int = param(32768, positive=True)
    rope_scaling: dict | None = None
    partial_rotary_factor: float = param(0.25, positive=True)
    linear_conv_kernel_dim: int = param(4, positive=True)
    linear_key_head_dim: int = param(128, positive=True)
    linear_value_head_dim: int = param(128, positive=True)
    linear_num_key_heads: int = param(16, positive=True)
    linear_num_value_heads: int = param(32, positive=True)
    decoder_sparse_step: int = param(1, positive=True)
    moe_intermediate_size: int = param(512, positive=True)
    shared_expert_intermediate_size: int = param(512, positive=True)
    num_experts_per_tok: int = param(10, positive=True)
    num_experts: int = param(512, nonnegative=True)
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] | None = param(None, nonnegative=True)  # None: none
    layer_types: list[str] | None = param(None, choices=LAYER_KINDS)  # else from full_attention_interval
    full_attention_interval: int = param(4, positive=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            n = self.full_attention_interval
            self.layer_types = [
                "full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_hidden_layers)
            ]

    def problems(self) -> list[str]:
        out = super().problems()
        bad = length_problem("layer_types", self.layer_types, self.num_hidden_layers)
        out += [bad] if bad else []
        if self.linear_num_value_heads % self.linear_num_key_heads:
            out.append(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            out.append(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
        if any(i >= self.num_hidden_layers for i in self.mlp_only_layers or []):
            out.append(
                f"mlp_only_layers {self.mlp_only_layers} has indices >= num_hidden_layers ({self.num_hidden_layers})"
            )
        if self.rotary_dim() < 2 or self.rotary_dim() > self.head_dim:
            out.append(
                f"partial_rotary_factor ({self.rope()['partial_rotary_factor']}) gives a rotary dim of "
                f"{self.rotary_dim()} for head_dim {self.head_dim}"
            )
        return out

    def rope(self) -> dict:
        """`rope_parameters` (transformers 5), or the older `rope_scaling` + `rope_theta` + `partial_rotary_factor`."""
        if self.rope_parameters:
            params = dict(self.rope_parameters)
        else:
            params = dict(self.rope_scaling or {})
            params.setdefault("rope_type", params.pop("type", "default"))
            params.setdefault("rope_theta", self.rope_theta)
        params.setdefault("partial_rotary_factor", self.partial_rotary_factor)
        return params

    def rotary_dim(self) -> int:
        return int(self.head_dim * float(self.rope()["partial_rotary_factor"]))

    def is_moe(self, i: int) -> bool:
        dense = i in (self.mlp_only_layers or []) or self.num_experts == 0
        return not dense and (i + 1) % self.decoder_sparse_step == 0


class Qwen3NextDecoderLayer(PreNormLayer):
    """h + mixer(input_layernorm(h)), then h + mlp(post_attention_layernorm(h)); mixer = linear_attn or self_attn."""

    delta_mixer: ClassVar[type[nn.Module]] = GatedDeltaNetMixer  # Qwen3.5 swaps in its split input projections

    def __init__(self, cfg: Qwen3NextConfig, kind: str, rotary: RotaryEmbedding, moe: bool) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = self.delta_mixer(
                d,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
                eps,
                cfg.hidden_act,
            )
        else:
            q_norm, k_norm = RMSNorm(cfg.head_dim, eps, unit_offset=True), RMSNorm(cfg.head_dim, eps, unit_offset=True)
            self.self_attn = AttentionMixer(
                **cfg.attention_mixer_args(), rotary=rotary, q_norm=q_norm, k_norm=k_norm, output_gate=True
            )
        if moe:
            self.mlp: nn.Module = SharedExpertMoE(
                d,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.shared_expert_intermediate_size,
                cfg.hidden_act,
                normalize=cfg.norm_topk_prob,
            )
        else:
            self.mlp = GatedMLP(d, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(d, eps, unit_offset=True)

    def pre_norm_parts(self) -> PreNormParts:
        mixer = self.linear_attn if self.kind == "linear_attention" else self.self_attn
        return PreNormParts(self.input_layernorm, mixer, self.post_attention_layernorm, self.mlp)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        mixer = self.linear_attn if self.kind == "linear_attention" else self.self_attn
        h, x = residual_norm(h, mixer(self.input_layernorm(h), layer, step), None, self.post_attention_layernorm)
        return h + self.mlp(x)


@register_family("qwen3_next")
class Qwen3NextLM(StackLM):
    family = "qwen3_next"
    config_class = Qwen3NextConfig
    final_norm_options = {"unit_offset": True}

    def shared(self) -> RotaryEmbedding:
        return self.cfg.rotary()  # over rotary_dim() channels: rope() carries partial_rotary_factor

    def build_layer(self, kind: str, index: int, rotary: RotaryEmbedding) -> Qwen3NextDecoderLayer:
        return Qwen3NextDecoderLayer(self.cfg, kind, rotary, self.cfg.is_moe(index))

    def native_layers(self) -> list[NativeLayer]:
        return delta_native_layers(self.cfg, self.kinds, self.dtype)

    def hf_name(self, name: str) -> str:
        return name.replace(".mlp.router.", ".mlp.gate.")  # HF calls the MoE router `gate`


def delta_native_layers(c: AttentionFields, kinds: list[str], dtype: torch.dtype) -> list[NativeLayer]:
    """Per layer kind: `gated_delta` for linear_attention, else `full` (Qwen3-Next, Qwen3.5, OLMo-Hybrid: configs
    with Qwen3-Next's linear_* fields)."""
    attn = {"num_kv_heads": c.num_key_value_heads, "head_dim": c.attention_head_dim, "dtype": dtype}
    delta = {
        "num_k_heads": c.linear_num_key_heads,
        "num_v_heads": c.linear_num_value_heads,
        "head_k_dim": c.linear_key_head_dim,
        "head_v_dim": c.linear_value_head_dim,
        "conv_kernel": c.linear_conv_kernel_dim,
        "dtype": dtype,
    }
    return [
        NativeLayer("gated_delta", dict(delta)) if t == "linear_attention" else NativeLayer("full", dict(attn))
        for t in kinds
    ]
