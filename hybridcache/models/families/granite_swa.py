"""GraniteSWA (IBM): Granite with per-layer full / sliding-window attention, learned per-head attention sinks and a
RoPE base per layer (`layer_rope_theta`, 0 = no positional embedding on that layer).

HF scales each head's attention output by sigmoid(logsumexp(scores) - sink): exactly one extra logit `sink` in the
softmax denominator, which is how AttentionMixer(sinks=True) computes it. Granite's multipliers are applied where HF
applies them: embedding_multiplier on the embeddings, residual_multiplier on each branch before the residual,
attention_multiplier as the softmax scale, and the logits divided by logits_scaling. Caches: `full` and `sliding`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.core.layer_pattern import SlidingFullFields
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput
from hybridcache.nn.attention.rotary import rope_frequencies


@dataclass(kw_only=True)
class GraniteSWAConfig(SlidingFullFields):
    """HF GraniteSWAConfig (transformers 5.23) fields the model reads, with HF defaults."""

    family: ClassVar[str] = "granite_swa"
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 100_257
    eos_token_id: int | list[int] | None = 100_257
    intermediate_size: int = param(8192, positive=True)
    num_attention_heads: int = param(20, positive=True)
    num_key_value_heads: int | None = param(4, positive=True)
    hidden_act: str = "silu"
    mlp_bias: bool = False
    rms_norm_eps: float = param(1e-5, positive=True)
    max_position_embeddings: int = param(8192, positive=True)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = param(1.0, positive=True)
    layer_rope_theta: list[float] | None = param(None, nonnegative=True)

    def default_layer_types(self) -> list[str]:  # HF: every fourth layer (i % 4 == 0) full, the others sliding
        return ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(self.num_hidden_layers)]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_rope_theta is None:
            self.layer_rope_theta = [self.rope()["rope_theta"]] * self.num_hidden_layers

    def problems(self) -> list[str]:
        bad = length_problem("layer_rope_theta", self.layer_rope_theta, self.num_hidden_layers)
        return super().problems() + ([bad] if bad else [])


class GraniteSWADecoderLayer(nn.Module):
    """h + m * self_attn(input_layernorm(h)), then h + m * mlp(post_attention_layernorm(h)), m the residual
    multiplier."""

    def __init__(self, cfg: GraniteSWAConfig, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = AttentionMixer(
            **cfg.attention_mixer_args(), scale=cfg.attention_multiplier, rotary=rotary, sinks=True
        )
        self.mlp = GatedMLP(d, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        h = h + self.self_attn(self.input_layernorm(h), layer, step) * self.residual_multiplier
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_multiplier


@register_family("granite_swa")
class GraniteSWALM(StackLM):
    family = "granite_swa"
    config_class = GraniteSWAConfig

    def plan(self) -> list[str]:
        return list(self.cfg.layer_types)

    def shared(self) -> dict[float, RotaryEmbedding]:
        """One rotary embedding per non-zero RoPE base (theta 0: that layer has none)."""
        cfg = self.cfg
        thetas = {t for t in cfg.layer_rope_theta if t}
        params = {t: {**cfg.rope(), "rope_theta": t} for t in thetas}
        return {t: RotaryEmbedding(*rope_frequencies(cfg.to_dict(), params[t], cfg.attention_head_dim)) for t in thetas}

    def build_layer(self, kind: str, index: int, shared: dict[float, RotaryEmbedding]) -> GraniteSWADecoderLayer:
        return GraniteSWADecoderLayer(self.cfg, shared.get(self.cfg.layer_rope_theta[index]))

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def native_layers(self) -> list[NativeLayer]:
        return self.cfg.native_layers(self.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.cfg.embedding_multiplier

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return super().head(h) / self.cfg.logits_scaling
