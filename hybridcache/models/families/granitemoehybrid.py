"""Granite 4.0 hybrid (IBM, HF "granitemoehybrid"): Mamba2 or attention per layer (`layer_types`), then a mixture
of SwiGLU experts plus an always-on shared SwiGLU MLP (or the shared MLP alone when num_local_experts is 0).

Granite's multipliers, and where they go:
- residual_multiplier scales every branch before it joins the residual stream: folded into the output projections
  (attention o_proj, Mamba out_proj, both MLP output_linear) by `convert_checkpoint`;
- embedding_multiplier and logits_scaling (a divisor) scale the embeddings and the logits: folded into
  embed_tokens / lm_head by `convert_checkpoint` when the head is untied; with tied embeddings one matrix serves
  both, so they are applied at run time instead;
- attention_multiplier is the softmax scale (replacing 1/sqrt(head_dim)): the attention mixer's `scale`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.accel import register_accel
from hybridcache.accel.mixers.moe import routed_experts_accel
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields, Mamba2Fields, MoEFields
from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, RMSNorm, RotaryEmbedding, StepInput, residual_norm
from hybridcache.nn.attention.rotary import rope_frequencies
from hybridcache.nn.core.mlp import ACTIVATIONS, activation
from hybridcache.nn.recurrent.mamba2 import Mamba2Mixer

LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' legacy layer type names


@dataclass(kw_only=True)
class GraniteMoeHybridConfig(AttentionFields, Mamba2Fields, MoEFields):
    """HF GraniteMoeHybridConfig (transformers 5) fields the model reads, with HF defaults. RoPE only when
    position_embedding_type is "rope" (Granite 4.0 hybrids use none); `rope_theta` serves older configs."""

    family: ClassVar[str] = "granitemoehybrid"
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    intermediate_size: int = param(11008, positive=True)
    hidden_act: str = param("silu", choices=tuple(ACTIVATIONS))
    max_position_embeddings: int = param(2048, positive=True)
    rms_norm_eps: float = param(1e-6, positive=True)
    embedding_multiplier: float = 1.0
    logits_scaling: float = param(1.0, positive=True)
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    shared_intermediate_size: int = param(1024, positive=True)
    position_embedding_type: str | None = None
    layer_types: list[str] | None = param(
        None, choices=("linear_attention", "full_attention", *LEGACY), aliases=("layers_block_type",)
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        types = self.layer_types or ["linear_attention"] * self.num_hidden_layers  # HF's default: all Mamba2
        self.layer_types = [LEGACY.get(t, t) for t in types]

    def problems(self) -> list[str]:
        out = super().problems()
        bad = length_problem("layer_types", self.layer_types, self.num_hidden_layers)
        out += [bad] if bad else []
        if "linear_attention" in self.layer_types and self.hidden_act not in ("silu", "swish"):
            out.append(f"hidden_act is also the Mamba conv activation, which must be silu, got {self.hidden_act!r}")
        return out


class SwiGLU(nn.Module):
    """Granite's shared MLP (HF names): input_linear -> [gate | up], output_linear(act(gate) * up)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


class ExpertWeights(nn.Module):
    """One stacked weight [E, out, in] for all experts (HF's file name `<name>.weight`)."""

    def __init__(self, experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, out_features, in_features))


class GraniteMoE(nn.Module):
    """router.layer (top-k logits, softmax over those k), stacked SwiGLU experts input_linear / output_linear.

    As in HF, routed outputs are weighted in the hidden dtype and summed there.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str = "silu") -> None:
        super().__init__()
        self.top_k, self.num_experts = top_k, num_experts
        self.router = nn.Module()
        self.router.layer = nn.Linear(hidden, num_experts, bias=False)
        self.input_linear = ExpertWeights(num_experts, 2 * intermediate, hidden)
        self.output_linear = ExpertWeights(num_experts, hidden, intermediate)
        self.act = activation(act)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, D]
        gate, up = F.linear(x, self.input_linear.weight[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.output_linear.weight[e])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k weights [N, k] (x.dtype) and expert indices [N, k] for tokens x [N, D]."""
        logits = self.router.layer(x).to(torch.promote_types(x.dtype, torch.float32))  # [N, E]
        top, index = logits.topk(self.top_k, dim=-1)  # [N, k]
        return torch.softmax(top, dim=-1).to(x.dtype), index

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        fast = self.__dict__.get("accel")  # hybridcache.accel's fast path (a decode token's experts), once installed
        if fast is not None:
            out = fast(h)
            if out is not None:
                return out
        x = h.reshape(-1, h.shape[-1])  # [N, D]
        weights, index = self.route(x)
        out = torch.zeros_like(x)
        if torch.compiler.is_compiling():  # static shapes: every expert on every token, zero weight if not routed
            dense = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
            dense.scatter_(1, index, weights)  # [N, E]
            for e in range(self.num_experts):
                out = out + self.expert(e, x) * dense[:, e, None]
        else:
            for e in torch.unique(index).tolist():  # only experts that received tokens
                token, slot = torch.where(index == e)
                out.index_add_(0, token, self.expert(e, x[token]) * weights[token, slot, None])
        return out.view_as(h)


register_accel(GraniteMoE, routed_experts_accel(GraniteMoE))  # a decode token's routed experts only, the same bits


class GraniteMoeHybridDecoderLayer(nn.Module):
    """h + mixer(input_layernorm(h)), then h + (moe + shared_mlp)(post_attention_layernorm(h)); the
    residual_multiplier is already in the output projections (see the module docstring)."""

    def __init__(self, cfg: GraniteMoeHybridConfig, kind: str, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = kind
        if kind == "linear_attention":
            self.mamba = Mamba2Mixer(**cfg.mamba2_mixer_args(), eps=eps, activation=cfg.hidden_act)
        else:
            self.self_attn = AttentionMixer(**cfg.attention_mixer_args(), scale=cfg.attention_multiplier, rotary=rotary)
        self.block_sparse_moe = (
            GraniteMoE(d, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_act)
            if cfg.num_local_experts > 0
            else None
        )
        self.shared_mlp = SwiGLU(d, cfg.shared_intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        mixer = self.mamba if self.kind == "linear_attention" else self.self_attn
        h, x = residual_norm(h, mixer(self.input_layernorm(h), layer, step), None, self.post_attention_layernorm)
        ff = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            ff = self.block_sparse_moe(x) + ff
        return h + ff


# Checkpoint tensors that feed the residual stream: residual_multiplier is folded into them.
_RESIDUAL_OUTPUTS = (
    ".self_attn.o_proj.",
    ".mamba.out_proj.",
    ".shared_mlp.output_linear.",
    ".block_sparse_moe.output_linear.",
)


@register_family("granitemoehybrid")
class GraniteMoeHybridLM(StackLM):
    family = "granitemoehybrid"
    config_class = GraniteMoeHybridConfig

    def __init__(self, config: Mapping[str, Any] | GraniteMoeHybridConfig) -> None:
        super().__init__(config)
        # Tied embeddings: one matrix is both embedding and head, so neither scaling can be folded into it.
        self.runtime_scales = self.cfg.tie_word_embeddings

    def plan(self) -> list[str]:
        return list(self.cfg.layer_types)

    def shared(self) -> RotaryEmbedding | None:
        c = self.cfg
        if c.position_embedding_type != "rope":
            return None
        rope = c.rope_parameters or {"rope_type": "default", "rope_theta": c.rope_theta}
        return RotaryEmbedding(*rope_frequencies(c.to_dict(), rope, c.head_dim))

    def build_layer(self, kind: str, index: int, rotary: RotaryEmbedding | None) -> GraniteMoeHybridDecoderLayer:
        return GraniteMoeHybridDecoderLayer(self.cfg, kind, rotary)

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def convert_checkpoint(self, state: dict) -> dict:
        """Fold the plain scalings into the weights (in float32 or wider, one rounding): residual_multiplier into
        every output projection, embedding_multiplier and 1 / logits_scaling into untied embeddings / head."""
        c = self.cfg

        def scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
            return t.to(torch.promote_types(t.dtype, torch.float32)) * factor if factor != 1.0 else t

        out = {}
        for name, t in state.items():
            if any(part in name for part in _RESIDUAL_OUTPUTS):
                t = scaled(t, c.residual_multiplier)
            elif name == "model.embed_tokens.weight" and not self.runtime_scales:
                t = scaled(t, c.embedding_multiplier)
            elif name == "lm_head.weight" and not self.runtime_scales:
                t = scaled(t, 1.0 / c.logits_scaling)
            out[name] = t
        return out

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        attn = {"num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "dtype": self.dtype}
        mamba = {**c.mamba2_cache_params(), "dtype": self.dtype}
        return [
            NativeLayer("mamba2", dict(mamba)) if t == "linear_attention" else NativeLayer("full", dict(attn))
            for t in self.types
        ]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # [B, T, D]
        return h * self.cfg.embedding_multiplier if self.runtime_scales else h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().head(h)  # [B, T, V]
        return logits / self.cfg.logits_scaling if self.runtime_scales else logits
