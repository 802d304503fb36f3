"""Llama4 text model: chunked-attention RoPE layers with L2 q/k norms, full-attention NoPE layers with attention
temperature tuning, dense and mixture-of-experts feed-forwards."""

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
from hybridcache.nn.attention.rotary import rope_frequencies
from hybridcache.nn.core.norms import WeightlessRMSNorm
from hybridcache.nn.moe.llama4 import Llama4MoE


@dataclass(kw_only=True)
class Llama4Config(AttentionFields):
    """HF Llama4TextConfig (transformers 5) fields the model reads, with HF defaults (older configs'
    `rope_scaling` + `rope_theta` are read when `rope_parameters` is absent)."""

    family: ClassVar[str] = "llama4"
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    intermediate_size: int = param(positive=True)
    intermediate_size_mlp: int = param(16384, positive=True)
    num_attention_heads: int = param(positive=True)
    num_key_value_heads: int | None = param(8, positive=True)  # None: num_attention_heads
    head_dim: int | None = param(128, positive=True)  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = param(1e-5, positive=True)
    max_position_embeddings: int = param(131_072, positive=True)
    num_experts_per_tok: int = param(1, positive=True)
    num_local_experts: int = param(16, positive=True)
    moe_layers: list[int] | None = param(None, nonnegative=True)  # else every interleave_moe_layer_step-th
    interleave_moe_layer_step: int = param(1, positive=True)
    use_qk_norm: bool = True
    rope_scaling: dict | None = None
    rope_theta: float = param(500_000.0, positive=True)
    no_rope_layers: list[int] | None = param(None, nonnegative=True)  # 1 = RoPE layer, 0 = NoPE layer
    no_rope_layer_interval: int = param(4, positive=True)
    attention_chunk_size: int | None = param(8192, positive=True)
    layer_types: list[str] | None = param(None, choices=("chunked_attention", "full_attention"))
    attn_temperature_tuning: bool = True
    floor_scale: int | float = param(8192, positive=True)
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim is None and self.hidden_size % self.num_attention_heads == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def problems(self) -> list[str]:
        out = super().problems()
        for name in ("layer_types", "no_rope_layers"):
            bad = length_problem(name, getattr(self, name), self.num_hidden_layers)
            out += [bad] if bad else []
        if any(f not in (0, 1) for f in self.no_rope_layers or []):
            out.append(f"no_rope_layers entries must be 0 or 1, got {self.no_rope_layers}")
        if any(i >= self.num_hidden_layers for i in self.moe_layers or []):
            out.append(f"moe_layers {self.moe_layers} has indices >= num_hidden_layers ({self.num_hidden_layers})")
        if self.num_experts_per_tok > self.num_local_experts:
            out.append(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_local_experts ({self.num_local_experts})"
            )
        return out

    @property
    def uses_rope(self) -> list[bool]:
        """Per layer: does it apply RoPE? (HF's `no_rope_layers` holds 1 for RoPE layers, 0 for NoPE layers.)"""
        flags = self.no_rope_layers
        if not flags:
            interval = self.no_rope_layer_interval
            flags = [int((i + 1) % interval != 0) for i in range(self.num_hidden_layers)]
        return [bool(f) for f in flags]

    @property
    def types(self) -> list[str]:
        if self.layer_types:
            return list(self.layer_types)
        return ["chunked_attention" if rope else "full_attention" for rope in self.uses_rope]

    @property
    def moe_layer_set(self) -> set[int]:
        if self.moe_layers is not None:
            return set(self.moe_layers)
        step = self.interleave_moe_layer_step
        return set(range(step - 1, self.num_hidden_layers, step))

    def rope(self) -> dict:
        """`rope_parameters` (transformers 5), or the older `rope_scaling` + `rope_theta` of saved configs."""
        if self.rope_parameters:
            return dict(self.rope_parameters)
        params = dict(self.rope_scaling or {"rope_type": "default"})
        params.setdefault("rope_type", params.pop("type", "default"))
        return {**params, "rope_theta": self.rope_theta}


class Llama4Rotary(RotaryEmbedding):
    """Complex-pair (interleaved) RoPE in (at least) float32, then the optional L2 q/k norm (HF order: rope, norm)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, qk_norm: WeightlessRMSNorm | None) -> None:
        super().__init__(inv_freq, scaling, interleaved=True)
        self.qk_norm = qk_norm

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 models
        rq, rk = super().forward(q.to(acc), k.to(acc), positions)  # [B, H, T, D]
        rq, rk = rq.to(q.dtype), rk.to(k.dtype)
        if self.qk_norm is not None:
            rq, rk = self.qk_norm(rq), self.qk_norm(rk)
        return rq, rk


class TemperatureTuning(nn.Module):
    """NoPE-layer query scaling 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)), by each row's own
    token position (left padding excluded), so padded rows equal unpadded runs."""

    def __init__(self, floor_scale: float, attn_scale: float) -> None:
        super().__init__()
        self.floor_scale, self.attn_scale = float(floor_scale), float(attn_scale)

    def forward(self, q: torch.Tensor, step: StepInput) -> torch.Tensor:  # q [B, H, T, D]
        pos = step.rope_positions.float()  # [B, T]; padding -> 0 (never attended to)
        scales = torch.log1p(torch.floor((pos + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (q * scales[:, None, :, None]).to(q.dtype)


class Llama4DecoderLayer(nn.Module):
    def __init__(self, cfg: Llama4Config, rotary: Llama4Rotary | None, is_moe: bool) -> None:
        super().__init__()
        d, eps, head_dim, act = cfg.hidden_size, cfg.rms_norm_eps, cfg.head_dim, cfg.hidden_act
        hook = None
        if rotary is None and cfg.attn_temperature_tuning:
            hook = TemperatureTuning(cfg.floor_scale, cfg.attn_scale)
        self.self_attn = AttentionMixer(
            d,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.attention_bias,
            scale=head_dim**-0.5,
            rotary=rotary,
            query_hook=hook,
        )
        if is_moe:
            self.feed_forward: nn.Module = Llama4MoE(
                d, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok, act
            )
        else:
            self.feed_forward = GatedMLP(d, cfg.intermediate_size_mlp, act)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        h, x = residual_norm(
            h, self.self_attn(self.input_layernorm(h), layer, step), None, self.post_attention_layernorm
        )
        return h + self.feed_forward(x)


@register_family("llama4_text")
class Llama4LM(StackLM):
    family = "llama4"
    config_class = Llama4Config

    def plan(self) -> list[str]:
        return self.cfg.types

    def shared(self) -> Llama4Rotary:
        inv_freq, scaling = rope_frequencies(self.cfg.to_dict(), self.cfg.rope(), self.cfg.head_dim)
        qk_norm = WeightlessRMSNorm(self.cfg.rms_norm_eps) if self.cfg.use_qk_norm else None
        return Llama4Rotary(inv_freq, scaling, qk_norm)

    def build_layer(self, kind: str, index: int, rotary: Llama4Rotary) -> Llama4DecoderLayer:
        rope = self.cfg.uses_rope[index]  # the RoPE layers share one rotary; the NoPE layers have none
        return Llama4DecoderLayer(self.cfg, rotary if rope else None, index in self.cfg.moe_layer_set)

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        attn = {"num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "dtype": self.dtype}
        chunk = c.attention_chunk_size
        return [
            NativeLayer("chunked", {**attn, "chunk_size": chunk})
            if t == "chunked_attention" and chunk
            else NativeLayer("full", attn)
            for t in self.types
        ]
