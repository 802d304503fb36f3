"""Jamba: interleaved Mamba (with dt/B/C norms) and attention layers without positional embeddings, MoE MLPs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields, MambaFields
from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, StepInput, residual_norm
from hybridcache.nn.core.pre_norm import PreNormLayer, PreNormParts
from hybridcache.nn.moe.topk import SparseMoE
from hybridcache.nn.recurrent.mamba import MambaMixer


@dataclass(kw_only=True)
class JambaConfig(AttentionFields, MambaFields):
    """HF JambaConfig (transformers 5) fields the model reads, with HF defaults (the Mamba ones in MambaFields);
    `num_local_experts` is an alias."""

    family: ClassVar[str] = "jamba"
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    intermediate_size: int = param(positive=True)
    num_attention_heads: int = param(positive=True)
    num_key_value_heads: int | None = param(8, positive=True)  # None: num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = param(1e-6, positive=True)
    max_position_embeddings: int = param(262144, positive=True)
    attn_layer_period: int = param(8, positive=True)
    attn_layer_offset: int = param(4, nonnegative=True)
    expert_layer_period: int = param(2, positive=True)
    expert_layer_offset: int = param(1, nonnegative=True)
    num_experts: int = param(16, positive=True, aliases=("num_local_experts",))
    num_experts_per_tok: int = param(2, positive=True)
    layers_block_type: list[str] | None = param(None, choices=("attention", "mamba"))  # else period/offset
    layers_num_experts: list[int] | None = param(None, positive=True)  # else expert period/offset

    def problems(self) -> list[str]:
        out = super().problems()
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
        for name in ("layers_block_type", "layers_num_experts"):
            bad = length_problem(name, getattr(self, name), self.num_hidden_layers)
            out += [bad] if bad else []
        return out

    @property
    def block_types(self) -> list[str]:
        """ "attention" or "mamba" per layer: `layers_block_type` if given, else from attn_layer_period/offset."""
        if self.layers_block_type:
            return list(self.layers_block_type)
        period, offset = self.attn_layer_period, self.attn_layer_offset
        return ["attention" if i % period == offset else "mamba" for i in range(self.num_hidden_layers)]

    @property
    def experts_per_layer(self) -> list[int]:
        """Experts per layer (1 = dense MLP): `layers_num_experts` if given, else expert period/offset."""
        if self.layers_num_experts:
            return list(self.layers_num_experts)
        period, offset, n = self.expert_layer_period, self.expert_layer_offset, self.num_experts
        return [n if i % period == offset else 1 for i in range(self.num_hidden_layers)]


class JambaDecoderLayer(PreNormLayer):
    """h + mixer(input_layernorm(h)), then h + feed_forward(pre_ff_layernorm(h)); mixer = self_attn or mamba."""

    def __init__(self, cfg: JambaConfig, kind: str, num_experts: int) -> None:
        super().__init__()
        d, eps, act = cfg.hidden_size, cfg.rms_norm_eps, cfg.hidden_act
        if kind == "attention":
            self.self_attn = AttentionMixer(
                d, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim
            )  # no rotary: Jamba has no positional embeddings
        else:
            self.mamba = MambaMixer(
                d,
                cfg.mamba_intermediate,
                cfg.mamba_d_state,
                cfg.mamba_d_conv,
                cfg.mamba_rank,
                conv_bias=cfg.mamba_conv_bias,
                proj_bias=cfg.mamba_proj_bias,
                activation=act,
                inner_norms=True,
                norm_eps=eps,
            )
        if num_experts > 1:
            self.feed_forward = SparseMoE(d, cfg.intermediate_size, num_experts, cfg.num_experts_per_tok, act)
        else:
            self.feed_forward = GatedMLP(d, cfg.intermediate_size, act)
        self.input_layernorm = RMSNorm(d, eps)
        self.pre_ff_layernorm = RMSNorm(d, eps)
        self.kind = kind

    def pre_norm_parts(self) -> PreNormParts:
        mixer = self.self_attn if self.kind == "attention" else self.mamba
        return PreNormParts(self.input_layernorm, mixer, self.pre_ff_layernorm, self.feed_forward)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        mixer = self.self_attn if self.kind == "attention" else self.mamba
        h, x = residual_norm(h, mixer(self.input_layernorm(h), layer, step), None, self.pre_ff_layernorm)
        return h + self.feed_forward(x)


@register_family("jamba")
class JambaLM(StackLM):
    family = "jamba"
    config_class = JambaConfig
    final_norm_name = "final_layernorm"

    def plan(self) -> list[str]:
        return self.cfg.block_types

    def build_layer(self, kind: str, index: int, shared: None) -> JambaDecoderLayer:
        return JambaDecoderLayer(self.cfg, kind, self.cfg.experts_per_layer[index])

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        attn = {"num_kv_heads": c.num_key_value_heads, "head_dim": c.attention_head_dim, "dtype": self.dtype}
        mamba = {**c.mamba_cache_params(), "dtype": self.dtype}
        return [NativeLayer("full", attn) if t == "attention" else NativeLayer("mamba", mamba) for t in self.types]
