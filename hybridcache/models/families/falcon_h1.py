"""Falcon-H1 (TII): every decoder layer runs attention and a Mamba2 mixer side by side on the same normed input.

    x = input_layernorm(h);  h = h + (mamba(x) + attention(x));  h = h + feed_forward(pre_ff_layernorm(h))

Each layer owns a cache group {"attention": full, "mamba": mamba2}. Falcon-H1's MuP multipliers are scalings of
linear maps, so `convert_checkpoint` folds them into the weights at load and the forward is a plain hybrid:

    embedding_multiplier      -> model.embed_tokens.weight           (runtime when the embeddings are tied)
    lm_head_multiplier        -> lm_head.weight                      (runtime when the embeddings are tied)
    attention_in_multiplier   -> q/k/v_proj weights (not biases: it scales the input)
    key_multiplier            -> k_proj weight and bias
    attention_out_multiplier  -> o_proj weight and bias
    ssm_in_multiplier         -> mamba.in_proj weight (not bias)
    ssm_multipliers [z, x, B, C, dt] -> mamba.in_proj rows of each block of outputs (weight and bias)
    ssm_out_multiplier        -> mamba.out_proj weight and bias
    mlp_multipliers [gate, down] -> feed_forward.gate_proj / down_proj weights and biases

Only tied embeddings keep multipliers at runtime: one matrix serves the embedding and the head, each with its own
factor. Folding is done in float64 and stored in (at least) float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hybridcache.cache import CacheGroup, NativeGroup, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields, Mamba2Fields
from hybridcache.models.core.family_config import param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput, residual_norm
from hybridcache.nn.recurrent.mamba2 import Mamba2Mixer


@dataclass(kw_only=True)
class FalconH1Config(AttentionFields, Mamba2Fields):
    """HF FalconH1Config (transformers 5) fields the model reads, with HF defaults. `head_dim` is not an HF field
    but HF's attention reads it when present (else hidden_size // num_attention_heads); real checkpoints set it."""

    family: ClassVar[str] = "falcon_h1"
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    intermediate_size: int = param(14336, positive=True)
    num_key_value_heads: int | None = param(8, positive=True)  # None: num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = param(1e-5, positive=True)
    max_position_embeddings: int = param(8192, positive=True)
    mamba_d_ssm: int | None = param(1024, positive=True)  # None: mamba_expand * hidden_size
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    projectors_bias: bool = False
    mlp_bias: bool = False
    lm_head_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    mlp_multipliers: list[float] | None = None  # [gate, down]; None: [1, 1]
    key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    ssm_multipliers: list[float] | None = None  # [z, x, B, C, dt]; None: [1] * 5
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_expand * self.hidden_size if self.mamba_d_ssm is None else self.mamba_d_ssm

    @property
    def mlp_factors(self) -> list[float]:
        return list(self.mlp_multipliers) if self.mlp_multipliers is not None else [1.0, 1.0]

    @property
    def ssm_factors(self) -> list[float]:
        return list(self.ssm_multipliers) if self.ssm_multipliers is not None else [1.0] * 5

    def problems(self) -> list[str]:
        out = super().problems()
        if self.mlp_multipliers is not None and len(self.mlp_multipliers) != 2:
            out.append(f"mlp_multipliers must be [gate, down], got {self.mlp_multipliers!r}")
        if self.ssm_multipliers is not None and len(self.ssm_multipliers) != 5:
            out.append(f"ssm_multipliers must be [z, x, B, C, dt], got {self.ssm_multipliers!r}")
        return out


class FalconH1DecoderLayer(nn.Module):
    """h + (mamba(x) + self_attn(x)) with x = input_layernorm(h), then the MLP (multipliers folded in)."""

    def __init__(self, cfg: FalconH1Config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.self_attn = AttentionMixer(**cfg.attention_mixer_args(), rotary=rotary)
        self.mamba = Mamba2Mixer(
            **cfg.mamba2_mixer_args(),
            out_bias=cfg.projectors_bias,
            rms_norm=cfg.mamba_rms_norm,
            norm_before_gate=cfg.mamba_norm_before_gate,
            eps=cfg.rms_norm_eps,
            activation=cfg.hidden_act,
        )
        self.feed_forward = GatedMLP(d, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, group: CacheGroup, step: StepInput) -> torch.Tensor:  # [B, T, D]
        x = self.input_layernorm(h)
        h, x = residual_norm(
            h,
            self.mamba(x, group["mamba"], step) + self.self_attn(x, group.attention, step),
            None,
            self.pre_ff_layernorm,
        )
        return h + self.feed_forward(x)


def _scale(state: dict[str, torch.Tensor], name: str, factor: float | torch.Tensor) -> None:
    """state[name] *= factor (per row when factor is a vector), in float64, kept in at least float32."""
    t = state.get(name)
    if t is None:
        return
    f = factor.to(torch.float64) if isinstance(factor, torch.Tensor) else float(factor)
    if isinstance(f, torch.Tensor) and t.dim() == 2:
        f = f[:, None]
    state[name] = (t.to(torch.float64) * f).to(torch.promote_types(t.dtype, torch.float32))


@register_family("falcon_h1")
class FalconH1LM(StackLM):
    family = "falcon_h1"
    config_class = FalconH1Config
    final_norm_name = "final_layernorm"

    def __init__(self, config: Mapping[str, Any] | FalconH1Config) -> None:
        super().__init__(config)
        tied = self.cfg.tie_word_embeddings  # one matrix, two factors: both stay at runtime
        self.embedding_scale = self.cfg.embedding_multiplier if tied else 1.0
        self.logit_scale = self.cfg.lm_head_multiplier if tied else 1.0

    def plan(self) -> list[str]:
        return ["parallel"] * self.cfg.num_hidden_layers  # attention and Mamba2 side by side in every layer

    def shared(self) -> RotaryEmbedding:
        return self.cfg.rotary()

    def build_layer(self, kind: str, index: int, rotary: RotaryEmbedding) -> FalconH1DecoderLayer:
        return FalconH1DecoderLayer(self.cfg, rotary)

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def in_proj_factors(self) -> torch.Tensor:
        """Per output row of mamba.in_proj ([z | x | B | C | dt]): its ssm_multipliers entry."""
        c = self.cfg
        inter, gn = c.mamba_intermediate, c.mamba_n_groups * c.mamba_d_state
        sizes = torch.tensor([inter, inter, gn, gn, c.mamba_n_heads])
        return torch.tensor(c.ssm_factors, dtype=torch.float64).repeat_interleave(sizes)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fold the MuP multipliers into the weights (see the module docstring)."""
        c = self.cfg
        rows = self.in_proj_factors()
        gate, down = c.mlp_factors
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            for proj in ("q_proj", "v_proj"):
                _scale(state, p + f"self_attn.{proj}.weight", c.attention_in_multiplier)
            _scale(state, p + "self_attn.k_proj.weight", c.attention_in_multiplier * c.key_multiplier)
            _scale(state, p + "self_attn.k_proj.bias", c.key_multiplier)
            for name in ("weight", "bias"):
                _scale(state, p + f"self_attn.o_proj.{name}", c.attention_out_multiplier)
                _scale(state, p + f"mamba.out_proj.{name}", c.ssm_out_multiplier)
                _scale(state, p + f"feed_forward.gate_proj.{name}", gate)
                _scale(state, p + f"feed_forward.down_proj.{name}", down)
            _scale(state, p + "mamba.in_proj.weight", rows * c.ssm_in_multiplier)
            _scale(state, p + "mamba.in_proj.bias", rows)
        if not c.tie_word_embeddings:
            _scale(state, "model.embed_tokens.weight", c.embedding_multiplier)
            _scale(state, "lm_head.weight", c.lm_head_multiplier)
        return state

    def native_layers(self) -> list[NativeGroup]:
        c = self.cfg
        attn = NativeLayer(
            "full", {"num_kv_heads": c.num_key_value_heads, "head_dim": c.attention_head_dim, "dtype": self.dtype}
        )
        mamba = NativeLayer("mamba2", {**c.mamba2_cache_params(), "dtype": self.dtype})
        return [NativeGroup({"attention": attn, "mamba": mamba}) for _ in range(c.num_hidden_layers)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # [B, T, D]
        return h * self.embedding_scale if self.embedding_scale != 1.0 else h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().head(h)  # [B, T, V]
        return logits * self.logit_scale if self.logit_scale != 1.0 else logits
