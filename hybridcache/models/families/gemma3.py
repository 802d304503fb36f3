"""Gemma3 text model: sliding-window and full attention layers, sandwich norms, q/k norms, scaled embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridcache.cache import NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields
from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding
from hybridcache.nn.attention.rotary import rope_frequencies
from hybridcache.nn.core.sandwich import SandwichLayer, SandwichParts

NATIVE_TYPE = {"sliding_attention": "sliding", "full_attention": "full"}


@dataclass(kw_only=True)
class Gemma3Config(AttentionFields):
    """HF Gemma3TextConfig (transformers 5) fields the model reads, with HF defaults. `rope_theta` and
    `rope_local_base_freq` (older configs) apply to full / sliding layers when `rope_parameters` is absent."""

    family: ClassVar[str] = "gemma3"
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    intermediate_size: int = param(positive=True)
    num_attention_heads: int = param(positive=True)
    num_key_value_heads: int | None = param(4, positive=True)
    head_dim: int = param(256, positive=True)
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = param(1e-6, positive=True)
    max_position_embeddings: int = param(131_072, positive=True)
    rope_theta: float = param(1_000_000.0, positive=True)
    rope_local_base_freq: float = param(10_000.0, positive=True)
    query_pre_attn_scalar: int | float = param(256, positive=True)
    sliding_window: int | None = param(4096, positive=True)
    sliding_window_pattern: int = param(6, positive=True, aliases=("_sliding_window_pattern",))
    layer_types: list[str] | None = param(None, choices=tuple(NATIVE_TYPE))  # else from sliding_window_pattern
    final_logit_softcapping: float | None = param(None, nonnegative=True)
    attn_logit_softcapping: float | None = param(None, nonnegative=True)

    def problems(self) -> list[str]:
        out = super().problems()
        bad = length_problem("layer_types", self.layer_types, self.num_hidden_layers)
        out += [bad] if bad else []
        if self.sliding_window is None and "sliding_attention" in self.types:
            out.append("sliding_window is null but there are sliding_attention layers")
        return out

    @property
    def types(self) -> list[str]:
        """Per layer: `layer_types`, else every `sliding_window_pattern`-th layer full, the others sliding."""
        if self.layer_types:
            return list(self.layer_types)
        pattern = self.sliding_window_pattern
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(self.num_hidden_layers)
        ]


class Gemma3DecoderLayer(SandwichLayer):
    """Sandwich norms around attention and the gated MLP (nn/core/sandwich.py holds the forward)."""

    def __init__(self, cfg: Gemma3Config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d, eps, head_dim = cfg.hidden_size, cfg.rms_norm_eps, cfg.head_dim
        self.self_attn = AttentionMixer(
            **cfg.attention_mixer_args(),
            scale=cfg.query_pre_attn_scalar**-0.5,
            softcap=cfg.attn_logit_softcapping,
            rotary=rotary,
            q_norm=RMSNorm(head_dim, eps, unit_offset=True),
            k_norm=RMSNorm(head_dim, eps, unit_offset=True),
        )
        self.mlp = GatedMLP(d, cfg.intermediate_size, cfg.hidden_activation)
        self.input_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)

    def parts(self) -> SandwichParts:
        return SandwichParts(
            self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.pre_feedforward_layernorm,
            self.mlp, self.post_feedforward_layernorm,
        )  # fmt: skip


@register_family("gemma3_text")
class Gemma3LM(StackLM):
    family = "gemma3"
    config_class = Gemma3Config

    def plan(self) -> list[str]:
        return self.cfg.types

    def shared(self) -> dict[str, RotaryEmbedding]:
        """One rotary embedding per layer kind: sliding layers use `rope_local_base_freq` unless rope_parameters
        names theirs."""
        cfg, rope, rotary = self.cfg, self.cfg.rope_parameters or {}, {}
        for kind in set(self.kinds):
            params = rope.get(kind) or {
                "rope_type": "default",
                "rope_theta": cfg.rope_local_base_freq if kind == "sliding_attention" else cfg.rope_theta,
            }
            rotary[kind] = RotaryEmbedding(*rope_frequencies(cfg.to_dict(), params, cfg.head_dim))
        return rotary

    def build_layer(self, kind: str, index: int, shared: dict[str, RotaryEmbedding]) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(self.cfg, shared[kind])

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps, unit_offset=True)

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        attn = {"num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "dtype": self.dtype}
        # only the sliding layers have a window: a type that takes one (sink, a score-based method over a window)
        # must not inherit it on a global layer
        return [
            NativeLayer(
                NATIVE_TYPE[t], {**attn, "window": c.sliding_window} if NATIVE_TYPE[t] == "sliding" else dict(attn)
            )
            for t in self.types
        ]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=h.dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().head(h)
        cap = self.cfg.final_logit_softcapping
        return cap * torch.tanh(logits / cap) if cap else logits

    # `embed` is the embedding table times sqrt(hidden) and `head` the final norm then lm_head (unless softcapped):
    # a fast path may compute them itself from `embed_head_parts` (accel/runs/decode_run.py's greedy loop). A subclass
    # that changes `embed` or `head` sets this False.
    plain_embed_head: ClassVar[bool] = True

    def embed_head_parts(self) -> tuple | None:
        """(the embedding module, the multiplier, the final norm, lm_head), or None where embed or head is another
        computation (a softcap, a subclass's own)."""
        if not self.plain_embed_head or self.cfg.final_logit_softcapping:
            return None
        multiplier = float(torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=torch.float32))
        return self.model.embed_tokens, multiplier, getattr(self.model, self.final_norm_name), self.lm_head
