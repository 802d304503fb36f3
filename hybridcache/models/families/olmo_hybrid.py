"""OLMo-Hybrid: Gated DeltaNet layers (Qwen3-Next's mixer with separate q/k/v/a/b/g projections, output norm eps
1e-5, beta in [0, 2] with `linear_allow_neg_eigval`; pre-norms) and OLMo 3 attention layers (post-norms, q/k RMS norms
over the whole projection; NoPE when rope_theta is None). Caches: `gated_delta` and `full`, as Qwen3-Next."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.accel import register_accel
from hybridcache.accel.mixers.delta import DeltaForm, delta_accel
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields
from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.models.families.qwen3_next import LAYER_KINDS, delta_native_layers
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, RotaryEmbedding, StepInput
from hybridcache.nn.core.pre_norm import PreNormLayer, PreNormParts
from hybridcache.nn.recurrent.gated_deltanet import GatedDeltaNetMixer


@dataclass(kw_only=True)
class OlmoHybridConfig(AttentionFields):
    """HF OlmoHybridConfig (transformers 5.23) fields, HF defaults; head_dim: config.json's if given (HF's attention
    reads it when present), else hidden_size // num_attention_heads."""

    family: ClassVar[str] = "olmo_hybrid"
    pad_token_id: int | None = 100277
    eos_token_id: int | list[int] | None = 100257
    intermediate_size: int = param(11008, positive=True)
    num_attention_heads: int = param(30, positive=True)
    max_position_embeddings: int = param(65536, positive=True)
    hidden_act: str = param("silu", choices=("silu", "swish"))
    layer_types: list[str] | None = param(None, choices=LAYER_KINDS)
    linear_num_key_heads: int | None = param(None, positive=True)
    linear_num_value_heads: int | None = param(None, positive=True)
    linear_key_head_dim: int | None = param(None, positive=True)
    linear_value_head_dim: int | None = param(None, positive=True)
    linear_conv_kernel_dim: int = param(4, positive=True)
    linear_allow_neg_eigval: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:  # HF: every 4th layer, and at least the last one, full attention
            self.layer_types = [LAYER_KINDS[i % 4 == 3] for i in range(self.num_hidden_layers)]
            if "full_attention" not in self.layer_types:
                self.layer_types[-1] = "full_attention"
        self.linear_num_key_heads = self.linear_num_key_heads or self.num_attention_heads
        self.linear_num_value_heads = self.linear_num_value_heads or self.num_attention_heads
        self.linear_key_head_dim = self.linear_key_head_dim or int(0.75 * self.hidden_size / self.linear_num_key_heads)
        self.linear_value_head_dim = self.linear_value_head_dim or 2 * self.linear_key_head_dim

    def problems(self) -> list[str]:
        out = super().problems() + [length_problem("layer_types", self.layer_types, self.num_hidden_layers)]
        if set(self.layer_types) != set(LAYER_KINDS):
            out.append(f"layer_types needs at least one linear_attention and one full_attention layer: {LAYER_KINDS}")
        if self.linear_num_value_heads != self.linear_num_key_heads:  # HF's mixer repeats no heads
            out.append(f"linear_num_value_heads must equal linear_num_key_heads ({self.linear_num_key_heads})")
        return [p for p in out if p]


class OlmoHybridGatedDeltaNet(GatedDeltaNetMixer):
    """Qwen3-Next's mixer with separate projections: q, k, v, a (decay), b (beta) and g (the output gate)."""

    def __init__(self, cfg: OlmoHybridConfig) -> None:
        d, hk, hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        super().__init__(d, hk, hv, dk, dv, cfg.linear_conv_kernel_dim, 1e-5, cfg.hidden_act)
        del self.in_proj_qkvz, self.in_proj_ba
        for name, width in (("q", hk * dk), ("k", hk * dk), ("v", hv * dv), ("a", hv), ("b", hv), ("g", hv * dv)):
            setattr(self, f"{name}_proj", nn.Linear(d, width, bias=False))
        self.beta_scale = 2.0 if cfg.linear_allow_neg_eigval else 1.0

    def _split(self, h: torch.Tensor):
        """q, k [B, T, Hk, Dk], v, z [B, T, Hv, Dv], b, a [B, T, Hv]."""
        q, k = (p(h).unflatten(-1, (self.hk, self.dk)) for p in (self.q_proj, self.k_proj))
        v, z = (p(h).unflatten(-1, (self.hv, self.dv)) for p in (self.v_proj, self.g_proj))
        return q, k, v, z, self.b_proj(h), self.a_proj(h)


# its decode step in one C call (accel/mixers/delta.py): q, k, v from three projections into one conv
OLMO_DELTA = DeltaForm(qkv=("q_proj", "k_proj", "v_proj"), convs=("conv1d",), z=("g_proj",), b="b_proj", a=("a_proj",))
register_accel(OlmoHybridGatedDeltaNet, delta_accel(OlmoHybridGatedDeltaNet, OLMO_DELTA))


class OlmoHybridAttention(AttentionMixer):
    """OLMo 3 attention: q_norm / k_norm normalise the whole q / k projection (all heads together)."""

    # its q / k norms span all heads (the fused kernel normalises per head)
    plain_projection = False

    def _project(self, h: torch.Tensor, step: StepInput, extra, prerope: bool = False) -> tuple:
        b, t, _ = h.shape
        qp, kp, vp = self.qkv(h)  # [B, T, H * D] each
        q, k, v = (x.view(b, t, -1, self.head_dim).transpose(1, 2) for x in (self.q_norm(qp), self.k_norm(kp), vp))
        q_pre = q if prerope else None
        q, k = (q, k) if self.rotary is None else self.rotary(q, k, step)
        return q, k, v, None, q_pre


class OlmoHybridDecoderLayer(PreNormLayer):
    """linear_attention: h + mixer(input_layernorm(h)), h + mlp(post_attention_layernorm(h)) (pre-norms);
    full_attention: h + post_attention_layernorm(attn(h)), h + post_feedforward_layernorm(mlp(h)) (post-norms)."""

    def __init__(self, cfg: OlmoHybridConfig, kind: str, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = lambda width: RMSNorm(width, eps, scale_in_float32=True)  # noqa: E731  (OLMo: weight * x in float32)
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = OlmoHybridGatedDeltaNet(cfg)
            self.input_layernorm = norm(d)
        else:
            hd, attn = cfg.attention_head_dim, cfg.attention_mixer_args()
            q_norm, k_norm = norm(cfg.num_attention_heads * hd), norm(cfg.num_key_value_heads * hd)
            self.self_attn = OlmoHybridAttention(**attn, rotary=rotary, q_norm=q_norm, k_norm=k_norm)
            self.post_feedforward_layernorm = norm(d)
        self.post_attention_layernorm = norm(d)
        self.mlp = GatedMLP(d, cfg.intermediate_size, cfg.hidden_act)

    def pre_norm_parts(self) -> PreNormParts | None:  # (the attention layers' post-norms are another shape)
        if self.kind != "linear_attention":
            return None
        return PreNormParts(self.input_layernorm, self.linear_attn, self.post_attention_layernorm, self.mlp)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        if self.kind == "linear_attention":
            h = h + self.linear_attn(self.input_layernorm(h), layer, step)
            return h + self.mlp(self.post_attention_layernorm(h))
        h = h + self.post_attention_layernorm(self.self_attn(h, layer, step))
        return h + self.post_feedforward_layernorm(self.mlp(h))


@register_family("olmo_hybrid")
class OlmoHybridLM(StackLM):
    family = "olmo_hybrid"
    config_class = OlmoHybridConfig
    final_norm_options = {"scale_in_float32": True}  # OLMo: weight * x in float32

    layer_class = OlmoHybridDecoderLayer

    def shared(self) -> RotaryEmbedding | None:  # NoPE when rope_theta is None (the released checkpoints)
        return None if self.cfg.rope()["rope_theta"] is None else self.cfg.rotary()

    def native_layers(self) -> list[NativeLayer]:
        return delta_native_layers(self.cfg, self.kinds, self.dtype)

    def hf_name(self, name: str) -> str:  # the mixer's gated norm and output projection under HF's names
        return name.replace(".linear_attn.norm.", ".linear_attn.o_norm.").replace(".out_proj.", ".o_proj.")

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """OLMo-core names (HF's conversion mapping, what HF saves): norm renames, q/k/v_conv1d -> conv1d."""
        for name in list(state):
            new = name.replace(".attention_layer_norm.", ".input_layernorm.")
            state[new.replace(".feedforward_layer_norm.", ".post_attention_layernorm.")] = state.pop(name)
        for name in [n for n in state if n.endswith(".q_conv1d.weight")]:
            p = name.removesuffix("q_conv1d.weight")
            state[p + "conv1d.weight"] = torch.cat([state.pop(p + f"{x}_conv1d.weight") for x in "qkv"])
        return state
