"""MiniMax (HF `model_type` "minimax", MiniMax-Text-01) as a hybridcache family plugin: no edit to hybridcache.

Layers (HF `layer_types`) are lightning attention (linear attention with a per-head decay; cache type `lightning`,
lightning.py) or softmax attention (`full`, `sliding` if `sliding_window`), each with a Mixtral MoE. The residual is
the *normed* input, scaled per layer type: x = input_layernorm(h), h = alpha x + beta attn(x); x =
post_attention_layernorm(h), out = alpha' x + beta' moe(x) (HF's *_alpha_factor / *_beta_factor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import AttentionFields, MoEFields
from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.nn import AttentionMixer, RMSNorm, RotaryEmbedding, StepInput
from hybridcache.nn.attention.rotary import rope_frequencies
from hybridcache.nn.core.mlp import activation
from hybridcache.nn.moe.topk import SparseMoE
from hybridcache_minimax.lightning import lightning_scan


@dataclass(kw_only=True)
class MiniMaxConfig(AttentionFields, MoEFields):
    """HF MiniMaxConfig (transformers 5) fields the model reads, with HF defaults; `num_experts` is an alias."""

    family: ClassVar[str] = "minimax"
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    intermediate_size: int = param(14336, positive=True)
    num_key_value_heads: int | None = param(8, positive=True)
    hidden_act: str = "silu"
    rms_norm_eps: float = param(1e-5, positive=True)
    max_position_embeddings: int = param(131072, positive=True)
    rope_theta: float = param(1e6, positive=True)
    sliding_window: int | None = param(None, positive=True)
    block_size: int = param(256, positive=True)  # HF's lightning block length (here: the chunk of the scan)
    layer_types: list[str] | None = param(None, choices=("full_attention", "linear_attention"))
    full_attn_alpha_factor: float = 1.0
    full_attn_beta_factor: float = 1.0
    linear_attn_alpha_factor: float = 1.0
    linear_attn_beta_factor: float = 1.0
    mlp_alpha_factor: float = 1.0
    mlp_beta_factor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_hidden_layers  # HF's default: full, linear, full, linear, ...
        self.layer_types = self.layer_types or ["linear_attention" if i % 2 else "full_attention" for i in range(n)]

    def problems(self) -> list[str]:
        bad = length_problem("layer_types", self.layer_types, self.num_hidden_layers)
        return super().problems() + ([bad] if bad else [])


class LightningAttention(nn.Module):
    """HF MiniMaxLightningAttention: act(qkv_proj) -> decayed linear attention -> RMSNorm -> sigmoid gate -> out."""

    def __init__(self, cfg: MiniMaxConfig, index: int) -> None:
        super().__init__()
        h, d, width = cfg.num_attention_heads, cfg.attention_head_dim, cfg.num_attention_heads * cfg.attention_head_dim
        self.heads, self.head_dim, self.act, self.chunk = h, d, activation(cfg.hidden_act), cfg.block_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * width, bias=False)
        self.output_gate = nn.Linear(cfg.hidden_size, width, bias=False)
        self.out_proj = nn.Linear(width, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(width)  # HF: eps 1e-6, not rms_norm_eps
        rate = (1 / 2 ** (8 / h)) ** torch.arange(1, h + 1) * (1 - index / (cfg.num_hidden_layers - 1 + 1e-5) + 1e-5)
        self.slope_rate = nn.Buffer(rate[:, None, None])  # [H, 1, 1] per-head decay rate (in the checkpoint)

    def forward(self, x: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        b, t, _ = x.shape
        qkv = step.mask_padding(self.act(self.qkv_proj(x))).view(b, t, self.heads, 3 * self.head_dim)
        acc, kv = torch.promote_types(x.dtype, torch.float32), layer.states["kv"]  # [B, H, D, D]
        q, k, v = (y.transpose(1, 2).to(acc) for y in qkv.split(self.head_dim, dim=-1))  # [B, H, T, D] each
        g = step.mask_padding((-self.slope_rate.view(1, 1, -1).to(acc)).expand(b, t, -1)).transpose(1, 2)
        part = lambda a, b: [y[:, :, a:b] for y in (q, k, v, g)]  # noqa: E731  (tokens a .. b-1)
        m = layer.trail_length(t)  # rollback on: the states after each of the last m tokens before the final
        o, kv = lightning_scan(*part(0, t - m), kv.to(acc), self.chunk)
        outs, trail = [o], []
        for i in range(t - m, t):  # those m tokens one by one, keeping the state before each
            trail.append(kv)
            o, kv = lightning_scan(*part(i, i + 1), kv)
            outs.append(o)
        dt = layer.states["kv"].dtype
        layer.update(kv=kv.to(dt), trail={"kv": torch.stack(trail, 1).to(dt)} if m else None)
        o = self.norm(torch.cat(outs, dim=2).transpose(1, 2).reshape(b, t, -1).to(x.dtype))
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * o)


class MiniMaxDecoderLayer(nn.Module):
    def __init__(self, cfg: MiniMaxConfig, kind: str, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d, linear = cfg.hidden_size, kind == "linear_attention"
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim)
        self.self_attn = LightningAttention(cfg, index) if linear else AttentionMixer(d, *heads, rotary=rotary)
        p = "linear_attn" if linear else "full_attn"
        self.alpha, self.beta = getattr(cfg, f"{p}_alpha_factor"), getattr(cfg, f"{p}_beta_factor")
        self.mlp_alpha, self.mlp_beta = cfg.mlp_alpha_factor, cfg.mlp_beta_factor
        self.block_sparse_moe = SparseMoE(
            d, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_act, normalize=True
        )
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        x = self.input_layernorm(h)
        x = self.post_attention_layernorm(self.alpha * x + self.beta * self.self_attn(x, layer, step))
        return self.mlp_alpha * x + self.mlp_beta * self.block_sparse_moe(x)


@register_family("minimax")
class MiniMaxLM(StackLM):
    family = "minimax"
    config_class = MiniMaxConfig
    # our names -> the checkpoint's (HF saves the MoE in its original Mixtral layout: gate, experts.E.w1 / w3 / w2)
    renames: ClassVar[dict[str, str]] = {"router": "gate", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def shared(self) -> RotaryEmbedding:
        rope = {"rope_type": "default", "rope_theta": self.cfg.rope_theta, **(self.cfg.rope_parameters or {})}
        return RotaryEmbedding(*rope_frequencies(self.cfg.to_dict(), rope, self.cfg.attention_head_dim))

    def build_layer(self, kind: str, index: int, shared: RotaryEmbedding) -> MiniMaxDecoderLayer:
        return MiniMaxDecoderLayer(self.cfg, kind, index, shared)

    def hf_name(self, name: str) -> str:
        return re.sub(r"\.(router|gate_proj|up_proj|down_proj)\.", lambda m: f".{self.renames[m[1]]}.", name)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF also saves the decay tables it derives from slope_rate; the model recomputes them from it."""
        return {k: v for k, v in state.items() if not k.endswith(("query_decay", "key_decay", "diagonal_decay"))}

    def native_layers(self) -> list[NativeLayer]:
        c, shape = self.cfg, {"head_dim": self.cfg.attention_head_dim, "dtype": self.dtype}
        attn = {**shape, "num_kv_heads": c.num_key_value_heads}
        softmax = NativeLayer("sliding", {**attn, "window": c.sliding_window}) if c.sliding_window else None
        native = {"linear_attention": NativeLayer("lightning", {**shape, "num_heads": c.num_attention_heads})}
        return [native.get(k) or softmax or NativeLayer("full", attn) for k in self.kinds]
