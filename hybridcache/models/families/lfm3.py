"""LFM3 (Liquid AI): LFM2's gated short convolutions plus full and sliding-window attention layers, sandwich norms
(each branch's output normalised before it joins the residual), a per-head sigmoid gate on attention outputs.

Full layers use "proportional" RoPE (the first partial_rotary_factor of each half-head rotated, the rest fixed),
sliding layers plain RoPE, each with its own theta. The per-head gate sigmoid(g_proj(x))_h is folded at load time
into a gated query projection: every query head's gate half repeats its g_proj row, so AttentionMixer's output gate
computes exactly it. Caches: `conv` (conv layers), `full` and `sliding` (attention layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.accel import register_accel
from hybridcache.accel.layers.sandwich_program import SandwichProgramAccel
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields
from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.models.families.lfm2 import ShortConv
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput, residual_norm
from hybridcache.nn.attention.rotary import rope_frequencies
from hybridcache.nn.core.sandwich import SandwichParts

NATIVE_TYPE = {"conv": "conv", "full_attention": "full", "sliding_attention": "sliding"}
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
}


@dataclass(kw_only=True)
class Lfm3Config(AttentionFields):
    """HF Lfm3Config (transformers 5.23) fields the model reads, with HF defaults. `rope_parameters` is per layer
    type (`layer_rotary`), so AttentionFields' single-rope rope() / rotary() do not apply; HF saves `norm_eps`."""

    family: ClassVar[str] = "lfm3"
    tie_word_embeddings: bool = param(True, aliases=("tie_embedding",))
    pad_token_id: int | None = 124_893
    bos_token_id: int | None = 124_894
    eos_token_id: int | list[int] | None = 124_900
    intermediate_size: int = param(7680, positive=True)
    num_attention_heads: int = param(16, positive=True)
    num_key_value_heads: int = param(4, positive=True)
    head_dim: int = param(128, positive=True)
    rms_norm_eps: float = param(1e-5, positive=True, aliases=("norm_eps",))
    max_position_embeddings: int = param(128_000, positive=True)
    conv_bias: bool = False
    conv_L_cache: int = param(7, positive=True)
    sliding_window: int = param(256, positive=True)
    layer_types: list[str] | None = param(None, choices=tuple(NATIVE_TYPE))
    use_sandwich_norm: bool = True
    use_attention_gate: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        rope = self.rope_parameters or DEFAULT_ROPE
        flat = "rope_type" in rope or "rope_theta" in rope  # one entry for every attention type
        self.rope_parameters = {t: dict(rope if flat else rope.get(t, {})) for t in DEFAULT_ROPE}
        if self.layer_types is None:  # HF: index 2 of every 4 full, 0 (but the first) sliding, the rest conv
            self.layer_types = [
                "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i else "conv"
                for i in range(self.num_hidden_layers)
            ]

    def problems(self) -> list[str]:
        out = super().problems()
        bad = length_problem("layer_types", self.layer_types, self.num_hidden_layers)
        out += [bad] if bad else []
        used = set(self.layer_types) - {"conv"}
        out += [
            f"rope_parameters has no rope_theta for {t}"
            for t in sorted(used)
            if "rope_theta" not in self.rope_parameters[t]
        ]
        return out


def layer_rotary(cfg: Lfm3Config, kind: str) -> RotaryEmbedding:
    """HF's per-type frequencies: proportional = head_dim / 2 angles of which the last ones are 0 (not rotated)."""
    params, hd = cfg.rope_parameters[kind], cfg.head_dim
    if params.get("rope_type") != "proportional":
        return RotaryEmbedding(*rope_frequencies(cfg.to_dict(), params, hd))
    rotated = int(params.get("partial_rotary_factor", 1.0) * hd // 2)
    inv_freq = 1.0 / params["rope_theta"] ** (torch.arange(0, 2 * rotated, 2).float() / hd)
    inv_freq = torch.cat([inv_freq, inv_freq.new_zeros(hd // 2 - rotated)]) / params.get("factor", 1.0)
    return RotaryEmbedding(inv_freq)


class Lfm3DecoderLayer(nn.Module):
    """h + post_operator_norm(operator(operator_norm(h))), then h + post_ffn_norm(feed_forward(ffn_norm(h)))."""

    def __init__(self, cfg: Lfm3Config, kind: str, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        d, eps, hd = cfg.hidden_size, cfg.rms_norm_eps, cfg.head_dim
        self.kind = kind
        if kind == "conv":
            self.conv = ShortConv(d, cfg.conv_L_cache, cfg.conv_bias)
        else:
            self.self_attn = AttentionMixer(
                **cfg.attention_mixer_args(),
                rotary=rotary,
                q_norm=RMSNorm(hd, eps),
                k_norm=RMSNorm(hd, eps),
                output_gate=cfg.use_attention_gate,  # the per-head gate, folded into q_proj (Lfm3LM)
            )
        self.feed_forward = GatedMLP(d, cfg.intermediate_size, "silu")
        self.operator_norm, self.ffn_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        sandwich = cfg.use_sandwich_norm
        self.post_operator_norm = RMSNorm(d, eps) if sandwich else None
        self.post_ffn_norm = RMSNorm(d, eps) if sandwich else None

    def sandwich_parts(self) -> SandwichParts:  # the layer's modules by role (a conv layer: the conv as the mixer)
        operator = self.conv if self.kind == "conv" else self.self_attn
        ops, ffn = (self.operator_norm, operator, self.post_operator_norm), (self.ffn_norm, self.feed_forward)
        return SandwichParts(*ops, *ffn, self.post_ffn_norm)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        operator = self.conv if self.kind == "conv" else self.self_attn
        h, x = residual_norm(h, operator(self.operator_norm(h), layer, step), self.post_operator_norm, self.ffn_norm)
        h, _ = residual_norm(h, self.feed_forward(x), self.post_ffn_norm, None)
        return h


register_accel(Lfm3DecoderLayer, SandwichProgramAccel)  # (its conv layers as records of a many-layer step)


@register_family("lfm3")
class Lfm3LM(StackLM):
    family = "lfm3"
    config_class = Lfm3Config
    final_norm_name = "embedding_norm"

    def shared(self) -> dict[str, RotaryEmbedding]:
        return {kind: layer_rotary(self.cfg, kind) for kind in set(self.cfg.layer_types) - {"conv"}}

    def build_layer(self, kind: str, index: int, shared: dict) -> Lfm3DecoderLayer:
        return Lfm3DecoderLayer(self.cfg, kind, shared.get(kind))

    def hf_name(self, name: str) -> str:  # LFM2's feed-forward names w1 / w3 / w2; attention keeps Qwen3's names
        for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            name = name.replace(f".feed_forward.{ours}.", f".feed_forward.{theirs}.")
        return name

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """q_proj [H*D, d] and the head gate (HF's g_proj, saved as gate_proj) [H, d] -> a gated q_proj [H*2D, d]:
        per head its D query rows, then its gate row D times (and a zero gate bias when q has a bias)."""
        h, d = self.cfg.num_attention_heads, self.cfg.head_dim
        for gate_name in [k for k in state if k.endswith((".self_attn.gate_proj.weight", ".self_attn.g_proj.weight"))]:
            prefix = gate_name.rsplit(".", 2)[0] + "."
            gate = state.pop(gate_name)[:, None].expand(h, d, -1)  # [H, D, d]
            q = state[prefix + "q_proj.weight"].view(h, d, -1)
            state[prefix + "q_proj.weight"] = torch.cat([q, gate.to(q.dtype)], 1).reshape(2 * h * d, -1)
            if prefix + "q_proj.bias" in state:
                b = state[prefix + "q_proj.bias"].view(h, d)
                state[prefix + "q_proj.bias"] = torch.cat([b, torch.zeros_like(b)], 1).reshape(-1)
        return state

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        attn = {"num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "dtype": self.dtype}
        conv = {"channels": c.hidden_size, "conv_kernel": c.conv_L_cache, "dtype": self.dtype}
        params = {"conv": conv, "full_attention": attn, "sliding_attention": {**attn, "window": c.sliding_window}}
        return [NativeLayer(NATIVE_TYPE[t], dict(params[t])) for t in self.kinds]
