"""Bamba (IBM): Mamba2 layers and a few full-attention layers with partial rotary embeddings, SwiGLU MLPs.

Decoder layer: h + mixer(input_layernorm(h)), then h + feed_forward(pre_ff_layernorm(h)); the mixer is a Mamba2 SSD
mixer (gated RMSNorm) or grouped-query attention rotating the first half of each head (`partial_rotary_factor`,
forced to 0.5 by HF's config unless `rope_parameters` sets it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields, Mamba2Fields
from hybridcache.models.core.family_config import param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput, residual_norm
from hybridcache.nn.core.pre_norm import PreNormLayer, PreNormParts
from hybridcache.nn.recurrent.mamba2 import Mamba2Mixer


@dataclass(kw_only=True)
class BambaConfig(AttentionFields, Mamba2Fields):
    """HF BambaConfig (transformers 5) fields the model reads, with HF defaults. `head_dim` is not an HF field but
    HF's attention reads it when present (else hidden_size // num_attention_heads)."""

    family: ClassVar[str] = "bamba"
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    intermediate_size: int = param(14336, positive=True)
    num_key_value_heads: int | None = param(8, positive=True)  # None: num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = param(1e-5, positive=True)
    max_position_embeddings: int = param(262144, positive=True)
    attn_layer_indices: list[int] | None = param(None, nonnegative=True)
    mlp_bias: bool = False
    # Not an HF field: a Bamba trained by experiment=train_window with its attention restricted to the last W tokens
    # (itself included). Its native attention cache is then sliding(W); HF's Bamba ignores the field, so it matches
    # HF only under that band mask (experiments/train_loop.model_logits).
    attention_window: int | None = param(None, positive=True)
    rope_defaults: ClassVar[dict[str, Any]] = {"partial_rotary_factor": 0.5}

    def problems(self) -> list[str]:
        out = super().problems()
        bad = [i for i in self.attn_layer_indices or [] if i >= self.num_hidden_layers]
        if bad:
            out.append(f"attn_layer_indices {bad} are >= num_hidden_layers ({self.num_hidden_layers})")
        return out


def mamba2_mixer(cfg: BambaConfig) -> Mamba2Mixer:
    return Mamba2Mixer(
        **cfg.mamba2_mixer_args(),
        rms_norm=True,
        norm_before_gate=False,
        eps=cfg.rms_norm_eps,
        activation=cfg.hidden_act,
    )


class BambaDecoderLayer(PreNormLayer):
    def __init__(self, cfg: BambaConfig, kind: str, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d = cfg.hidden_size
        if kind == "attention":
            self.self_attn = AttentionMixer(**cfg.attention_mixer_args(), rotary=rotary)
        else:
            self.mamba = mamba2_mixer(cfg)
        self.feed_forward = GatedMLP(d, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.kind = kind

    def pre_norm_parts(self) -> PreNormParts:
        mixer = self.self_attn if self.kind == "attention" else self.mamba
        return PreNormParts(self.input_layernorm, mixer, self.pre_ff_layernorm, self.feed_forward)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        mixer = self.self_attn if self.kind == "attention" else self.mamba
        h, x = residual_norm(h, mixer(self.input_layernorm(h), layer, step), None, self.pre_ff_layernorm)
        return h + self.feed_forward(x)


@register_family("bamba")
class BambaLM(StackLM):
    family = "bamba"
    config_class = BambaConfig
    final_norm_name = "final_layernorm"

    def plan(self) -> list[str]:
        attn = set(self.cfg.attn_layer_indices or [])
        return ["attention" if i in attn else "mamba" for i in range(self.cfg.num_hidden_layers)]

    def shared(self) -> RotaryEmbedding:
        return self.cfg.rotary()

    def build_layer(self, kind: str, index: int, shared: RotaryEmbedding) -> BambaDecoderLayer:
        return BambaDecoderLayer(self.cfg, kind, shared)

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        attn = {"num_kv_heads": c.num_key_value_heads, "head_dim": c.attention_head_dim, "dtype": self.dtype}
        mamba = {**c.mamba2_cache_params(), "dtype": self.dtype}
        full = (
            NativeLayer("sliding", {**attn, "window": c.attention_window})
            if c.attention_window
            else NativeLayer("full", attn)
        )
        return [full if k == "attention" else NativeLayer("mamba2", mamba) for k in self.kinds]
