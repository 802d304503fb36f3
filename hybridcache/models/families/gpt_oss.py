"""GPT-OSS (OpenAI): alternating sliding-window and full attention with learned per-head attention sinks, q/k/v/o
biases and YaRN RoPE; every MLP is a top-k mixture of experts with a biased router and a clamped SwiGLU.

Attention sinks are one extra logit per head in the softmax denominator (AttentionMixer(sinks=True)). The router
takes the top-k of its biased logits and softmaxes those k. An expert computes, on its interleaved gate/up columns,
(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=l), then its biased down projection.
Caches: `full` and `sliding`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.accel import register_accel
from hybridcache.accel.mixers.moe import oss_experts_accel
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import MoEFields
from hybridcache.models.core.family_config import param
from hybridcache.models.core.layer_pattern import SlidingFullFields
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, RMSNorm, RotaryEmbedding, StepInput

DEFAULT_ROPE = {  # HF's when the config has no rope_parameters
    **{"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0},
    **{"truncate": False, "original_max_position_embeddings": 4096},
}


@dataclass(kw_only=True)
class GptOssConfig(SlidingFullFields, MoEFields):
    """HF GptOssConfig (transformers 5.23) fields the model reads, with HF defaults."""

    family: ClassVar[str] = "gpt_oss"
    intermediate_size: int = param(2880, positive=True)
    num_attention_heads: int = param(64, positive=True)
    num_key_value_heads: int | None = param(8, positive=True)
    head_dim: int | None = param(64, positive=True)
    attention_bias: bool = True
    rms_norm_eps: float = param(1e-5, positive=True)
    max_position_embeddings: int = param(131_072, positive=True)
    rope_theta: float = param(150_000.0, positive=True)  # HF's default_theta, under rope_parameters
    num_local_experts: int = param(128, positive=True, aliases=("num_experts",))
    num_experts_per_tok: int = param(4, positive=True)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = param(7.0, positive=True)

    def default_layer_types(self) -> list[str]:  # HF: even layers sliding, odd layers full
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rope_parameters = self.rope_parameters or dict(DEFAULT_ROPE)


class GptOssExperts(nn.Module):
    """HF's expert tensors: gate_up_proj [E, D, 2I] (gate and up interleaved by column), down_proj [E, I, D], and
    their biases."""

    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        e, d, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, d, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.zeros(e, i, d))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, d))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def expert(self, x: torch.Tensor, e: int | torch.Tensor) -> torch.Tensor:
        """Expert(s) `e` on tokens x: [N, D] with an int e, or [N, k, D] with e [N, k] (one expert per slot)."""
        w, b = self.gate_up_proj[e], self.gate_up_proj_bias[e]  # [D, 2I] / [N, k, D, 2I]
        gate_up = (x @ w if w.dim() == 2 else torch.einsum("nkd,nkdf->nkf", x, w)) + b
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        a = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        w, b = self.down_proj[e], self.down_proj_bias[e]
        return (a @ w if w.dim() == 2 else torch.einsum("nkf,nkfd->nkd", a, w)) + b


class GptOssMoE(nn.Module):
    """`router` (biased linear) picks the top-k experts per token by logit; their weights are the softmax of those
    k logits."""

    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.experts = GptOssExperts(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        fast = self.__dict__.get("accel")  # hybridcache.accel's fast path (a decode token's experts), once installed
        if fast is not None:
            out = fast(h)
            if out is not None:
                return out
        x = h.reshape(-1, h.shape[-1])  # [N, D]
        top, index = torch.topk(self.router(x), self.top_k, dim=-1)  # [N, k]
        weights = torch.softmax(top, dim=-1)
        n, experts = x.shape[0], self.experts
        if torch.compiler.is_compiling() or n * self.top_k <= experts.down_proj.shape[0]:  # few tokens: gather
            out = experts.expert(x[:, None].expand(n, self.top_k, -1), index)  # [N, k, D], static shapes
            return (out * weights[..., None]).sum(1).view_as(h)
        out = torch.zeros_like(x)
        for e in torch.unique(index).tolist():
            token, slot = torch.where(index == e)  # tokens routed to expert e, and which of their k slots
            out.index_add_(0, token, experts.expert(x[token], e) * weights[token, slot, None])
        return out.view_as(h)


register_accel(GptOssMoE, oss_experts_accel(GptOssMoE))  # a decode token's experts in one C call


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: GptOssConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = AttentionMixer(**cfg.attention_mixer_args(), rotary=rotary, sinks=True)
        self.mlp = GptOssMoE(cfg)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        h = h + self.self_attn(self.input_layernorm(h), layer, step)
        return h + self.mlp(self.post_attention_layernorm(h))


@register_family("gpt_oss")
class GptOssLM(StackLM):
    family = "gpt_oss"
    config_class = GptOssConfig

    def plan(self) -> list[str]:
        return list(self.cfg.layer_types)

    def shared(self) -> RotaryEmbedding:
        return self.cfg.rotary()

    def build_layer(self, kind: str, index: int, shared: RotaryEmbedding) -> GptOssDecoderLayer:
        return GptOssDecoderLayer(self.cfg, shared)

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def native_layers(self) -> list[NativeLayer]:
        return self.cfg.native_layers(self.dtype)
