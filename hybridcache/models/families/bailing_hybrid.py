"""Bailing-hybrid (inclusionAI Ling 3): Kimi Linear's layout (KDA + MLA layers, DeepSeek-V3 MoE or dense MLPs) with
a full-rank, optionally bounded KDA forget gate and full-rank output gate, MLA with interleaved RoPE on the rope dims
and a per-head sigmoid output gate, and the full-attention layer last in every `layer_group_size` layers.
Caches: `gated_delta` and `full`, as Kimi Linear's."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridcache.models.core.family_config import param
from hybridcache.models.core.registry import register_family
from hybridcache.models.families.kimi_linear import MLA_DIMS, KimiLinearConfig, KimiLinearDecoderLayer, KimiLinearLM
from hybridcache.nn import GatedMLP, RMSNorm
from hybridcache.nn.attention.mla import MLAMixer
from hybridcache.nn.attention.rotary import RotaryEmbedding, rope_frequencies
from hybridcache.nn.moe.deepseek import DeepseekMoE
from hybridcache.nn.recurrent.kda import BailingDeltaAttention


@dataclass(kw_only=True)
class BailingHybridConfig(KimiLinearConfig):
    """HF BailingHybridConfig: Kimi Linear's fields with Ling's defaults. As HF, the KDA layers have
    num_attention_heads heads of `head_dim` (HF saves head_dim = qk_rope_head_dim after loading: a checkpoint it
    wrote reads back so), with `short_conv_kernel_size` convs."""

    family: ClassVar[str] = "bailing_hybrid"
    vocab_size: int = param(157184, positive=True)
    hidden_size: int = param(2560, positive=True)
    intermediate_size: int = param(6144, positive=True)
    moe_intermediate_size: int = param(768, positive=True)
    num_hidden_layers: int = param(42, positive=True)
    num_local_experts: int = param(512, nonnegative=True, aliases=("num_experts",))
    n_group: int = param(8, positive=True, aliases=("num_expert_group",))
    topk_group: int = param(4, positive=True)
    routed_scaling_factor: float = param(2.5, positive=True)
    first_k_dense_replace: int = param(2, nonnegative=True)
    max_position_embeddings: int = param(262144, positive=True, aliases=("model_max_length",))
    rms_norm_eps: float = param(1e-6, positive=True)
    pad_token_id: int | None = 156892
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 156895
    rope_theta: float = param(6_000_000.0, positive=True)
    head_dim: int | None = param(128, positive=True)
    short_conv_kernel_size: int = param(4, positive=True)
    layer_group_size: int = param(6, positive=True)
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0

    def __post_init__(self) -> None:
        self.linear_head_dim, self.linear_num_heads = self.head_dim, self.num_attention_heads
        self.linear_conv_kernel_dim, self.linear_attn_config = self.short_conv_kernel_size, None
        if self.layer_types is None:
            g = self.layer_group_size
            self.layer_types = [
                "full_attention" if (i + 1) % g == 0 else "linear_attention" for i in range(self.num_hidden_layers)
            ]
        super().__post_init__()


class BailingHybridDecoderLayer(KimiLinearDecoderLayer):
    def __init__(self, cfg: BailingHybridConfig, kind: str, sparse: bool, rotary: RotaryEmbedding) -> None:
        super(KimiLinearDecoderLayer, self).__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        if kind == "linear_attention":
            kda = (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim, eps)
            gate = {"safe_gate": cfg.kda_safe_gate, "lower_bound": cfg.kda_lower_bound}
            self.self_attn: torch.nn.Module = BailingDeltaAttention(d, *kda, **gate)
        else:  # HF's q_a / kv_a layernorms keep RMSNorm's default eps (1e-6)
            mla = {k: getattr(cfg, k) for k in MLA_DIMS}
            heads = cfg.num_attention_heads
            self.self_attn = MLAMixer(d, heads, **mla, bias=cfg.attention_bias, rotary=rotary, head_gate=True)
        if sparse:
            router = {k: getattr(cfg, k) for k in ("n_group", "topk_group", "routed_scaling_factor")}
            moe = (cfg.moe_intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.n_shared_experts)
            self.mlp: torch.nn.Module = DeepseekMoE(d, *moe, cfg.hidden_act, normalize=cfg.norm_topk_prob, **router)
        else:
            self.mlp = GatedMLP(d, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)


# Ling's saved names -> ours (HF's conversion_mapping: what save_pretrained writes back)
_RENAMES = [
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@register_family("bailing_hybrid")
class BailingHybridLM(KimiLinearLM):
    family = "bailing_hybrid"
    config_class = BailingHybridConfig

    def shared(self) -> RotaryEmbedding:  # MLA's rope dims, interleaved pairs (HF: apply_rotary_pos_emb_interleave)
        c = self.cfg
        return RotaryEmbedding(*rope_frequencies(c.to_dict(), c.rope(), c.qk_rope_head_dim), interleaved=True)

    def build_layer(self, kind: str, index: int, rotary: RotaryEmbedding) -> BailingHybridDecoderLayer:
        return BailingHybridDecoderLayer(self.cfg, kind, self.cfg.mlp_layer_types[index] == "sparse", rotary)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, value in state.items():
            layer = _LAYER.match(name)
            if layer and int(layer.group(1)) >= self.cfg.num_hidden_layers:
                continue  # multi-token-prediction layers, unused in causal inference (HF skips them too)
            for pattern, new in _RENAMES:
                name = pattern.sub(new, name)
            if name.endswith(".self_attn.conv1d.weight"):  # HF's packed [q | k | v] conv: ours is one per part
                for part, w in zip("qkv", value.chunk(3), strict=True):
                    out[name.replace("conv1d", f"{part}_conv1d")] = w
                continue
            out[name] = value
        return out
