"""Kimi Linear (Moonshot): Kimi Delta Attention (gated delta rule, decay per key channel) and multi-head latent
attention without positional encoding (MLA, NoPE) layers; DeepSeek-V3 MoE or dense MLPs per `mlp_layer_types`.
Caches: `gated_delta` (conv over [q | k | v] + the delta-rule state) and `full` (decompressed MLA keys and values,
padded to one head width)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields, MoEFields
from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import GatedMLP, RMSNorm, StepInput, residual_norm
from hybridcache.nn.attention.mla import MLAMixer
from hybridcache.nn.core.pre_norm import PreNormLayer, PreNormParts
from hybridcache.nn.moe.deepseek import DeepseekMoE
from hybridcache.nn.recurrent.kda import KimiDeltaAttention


@dataclass(kw_only=True)
class KimiLinearConfig(AttentionFields, MoEFields):
    """HF KimiLinearConfig fields the model reads, with HF defaults and the names HF saves (aliases). A checkpoint's
    `linear_attn_config` (head_dim, num_heads, short_conv_kernel_size, 1-based full_attn_layers / kda_layers) wins
    over the linear_* fields, as in HF."""

    family: ClassVar[str] = "kimi_linear"
    pad_token_id: int | None = 163839
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163586
    num_key_value_heads: int | None = param(32, positive=True)  # None: num_attention_heads
    intermediate_size: int = param(9216, positive=True)
    moe_intermediate_size: int = param(1024, positive=True)
    max_position_embeddings: int = param(1048576, positive=True, aliases=("model_max_length",))
    rms_norm_eps: float = param(1e-5, positive=True)
    hidden_act: str = param("silu", choices=("silu",))
    num_local_experts: int = param(256, nonnegative=True, aliases=("num_experts", "n_routed_experts"))
    num_experts_per_tok: int = param(8, positive=True, aliases=("num_experts_per_token",))
    n_shared_experts: int = param(1, nonnegative=True, aliases=("num_shared_experts",))
    routed_scaling_factor: float = param(2.446, positive=True)
    n_group: int = param(1, positive=True, aliases=("num_expert_group",))
    topk_group: int = param(1, positive=True)
    norm_topk_prob: bool = param(True, aliases=("moe_renormalize",))
    q_lora_rank: int | None = param(None, positive=True)
    kv_lora_rank: int = param(512, positive=True)
    qk_nope_head_dim: int = param(128, positive=True)
    qk_rope_head_dim: int = param(64, positive=True)
    v_head_dim: int = param(128, positive=True)
    linear_head_dim: int = param(128, positive=True)
    linear_num_heads: int = param(32, positive=True)
    linear_conv_kernel_dim: int = param(4, positive=True)
    linear_attn_config: dict | None = None
    first_k_dense_replace: int = param(1, nonnegative=True)
    layer_types: list[str] | None = param(None, choices=("full_attention", "linear_attention"))
    mlp_layer_types: list[str] | None = param(None, choices=("dense", "sparse"))

    def __post_init__(self) -> None:
        super().__post_init__()
        lin, n = self.linear_attn_config or {}, self.num_hidden_layers
        self.linear_head_dim = lin.get("head_dim", self.linear_head_dim)
        self.linear_num_heads = lin.get("num_heads", self.linear_num_heads)
        self.linear_conv_kernel_dim = lin.get("short_conv_kernel_size", self.linear_conv_kernel_dim)
        if self.layer_types is None and "full_attn_layers" in lin and "kda_layers" in lin:
            full = set(lin["full_attn_layers"])  # 1-based
            self.layer_types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
        elif self.layer_types is None:
            self.layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)]

    def problems(self) -> list[str]:
        out = super().problems()
        n = self.num_hidden_layers
        out += [p for p in (length_problem(k, getattr(self, k), n) for k in ("layer_types", "mlp_layer_types")) if p]
        if self.num_key_value_heads != self.num_attention_heads:  # kv_b_proj gives one key / value per query head
            out.append(f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads (MLA)")
        if self.num_local_experts % self.n_group or self.topk_group > self.n_group:
            out.append(f"n_group ({self.n_group}) must divide num_local_experts and be >= topk_group")
        return out


MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class KimiLinearDecoderLayer(PreNormLayer):
    def __init__(self, cfg: KimiLinearConfig, kind: str, sparse: bool) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        if kind == "linear_attention":
            kda = (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim)
            self.self_attn: nn.Module = KimiDeltaAttention(d, *kda, eps)
        else:  # HF's q_a / kv_a layernorms keep RMSNorm's default eps (1e-6)
            mla = {k: getattr(cfg, k) for k in MLA_DIMS}
            self.self_attn = MLAMixer(d, cfg.num_attention_heads, **mla, bias=cfg.attention_bias)
        if sparse:
            router = {k: getattr(cfg, k) for k in ("n_group", "topk_group", "routed_scaling_factor")}
            moe = (cfg.moe_intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.n_shared_experts)
            self.mlp: nn.Module = DeepseekMoE(d, *moe, cfg.hidden_act, normalize=cfg.norm_topk_prob, **router)
        else:
            self.mlp = GatedMLP(d, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def pre_norm_parts(self) -> PreNormParts:
        return PreNormParts(self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        x = self.self_attn(self.input_layernorm(h), layer, step)
        h, x = residual_norm(h, x, None, self.post_attention_layernorm)
        return h + self.mlp(x)


_RENAMES = [
    (r"\.block_sparse_moe\.", ".mlp."),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    (r"\.self_attn\.forget_gate\.", ".self_attn."),
]


@register_family("kimi_linear")
class KimiLinearLM(StackLM):
    family = "kimi_linear"
    config_class = KimiLinearConfig

    def plan(self) -> list[str]:
        return list(self.cfg.layer_types)

    def build_layer(self, kind: str, index: int, shared: None) -> KimiLinearDecoderLayer:
        return KimiLinearDecoderLayer(self.cfg, kind, self.cfg.mlp_layer_types[index] == "sparse")

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # HF saves Kimi's names
        return {functools.reduce(lambda n, r: re.sub(*r, n), _RENAMES, k): v for k, v in state.items()}

    def native_layers(self) -> list[NativeLayer]:
        c, dtype = self.cfg, self.dtype
        width = max(c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim)  # the MLA cache's padded head width
        h, d = c.linear_num_heads, c.linear_head_dim
        delta = dict(num_k_heads=h, num_v_heads=h, head_k_dim=d, head_v_dim=d, conv_kernel=c.linear_conv_kernel_dim)
        full = {"num_kv_heads": c.num_attention_heads, "head_dim": width}
        kinds = {"linear_attention": ("gated_delta", delta), "full_attention": ("full", full)}
        return [NativeLayer(kinds[t][0], {**kinds[t][1], "dtype": dtype}) for t in self.kinds]
