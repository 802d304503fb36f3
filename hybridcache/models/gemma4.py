"""Gemma 4 text: sliding and global attention (global layers: own head_dim / kv heads, keys as values with
`attention_k_eq_v`, proportional RoPE), q/k/v and sandwich norms, per-layer input embeddings (PLE), experts beside the
MLP (`enable_moe_block`), a per-layer output scalar. KV sharing: the last `num_kv_shared_layers` layers have no k/v
and no cache entry, they attend to what the last earlier layer of their type attended to in the block; the cache
holds the writers' entries only (at their own indices), so rollback / save / load are theirs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.blocks import GatedMLP, RMSNorm, RotaryEmbedding, StepInput, residual_norm
from hybridcache.blocks.gemma4_moe import Gemma4MoEBranch
from hybridcache.blocks.kv_shared_attention import KVSharedAttention, layer_rotary
from hybridcache.blocks.per_layer_embeddings import PerLayerEmbeddings, PerLayerInput
from hybridcache.cache import Cache, CacheLayer, NativeLayer
from hybridcache.models.family_config import param
from hybridcache.models.layer_pattern import SlidingFullFields
from hybridcache.models.registry import register_family
from hybridcache.models.stack import StackLM

DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(kw_only=True)
class Gemma4Config(SlidingFullFields):
    """HF Gemma4TextConfig (transformers 5.23) fields the model reads, with HF defaults. Global layers take
    `per_layer_config` (what HF saves), else `global_head_dim` / `num_global_key_value_heads` (its init kwargs)."""

    family: ClassVar[str] = "gemma4"
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 1
    intermediate_size: int = param(9216, positive=True)
    num_attention_heads: int = param(8, positive=True)
    num_key_value_heads: int | None = param(4, positive=True)
    head_dim: int | None = param(256, positive=True)
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = param(131_072, positive=True)
    sliding_window: int | None = param(512, positive=True)
    final_logit_softcapping: float | None = param(None, positive=True)
    use_bidirectional_attention: str | None = param(None, choices=("vision", "all"))
    vocab_size_per_layer_input: int = param(262_144, positive=True)
    hidden_size_per_layer_input: int | None = param(256, nonnegative=True)  # 0 / None: no PLE
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = param(0, nonnegative=True)
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = param(None, positive=True)
    top_k_experts: int | None = param(None, positive=True)
    moe_intermediate_size: int | None = param(None, positive=True)
    global_head_dim: int = param(512, positive=True)
    num_global_key_value_heads: int | None = param(None, positive=True)
    per_layer_config: dict | None = None

    def default_layer_types(self) -> list[str]:  # 5 sliding : 1 global
        return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(self.num_hidden_layers)]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_types = [*self.layer_types[:-1], "full_attention"]  # HF forces the last layer global
        self.rope_parameters = self.rope_parameters or DEFAULT_ROPE
        if self.per_layer_config is None:
            kv = self.num_global_key_value_heads if self.attention_k_eq_v else None
            over = {"head_dim": self.global_head_dim, **({"num_key_value_heads": kv} if kv else {})}
            self.per_layer_config = {str(i): over for i, t in enumerate(self.layer_types) if t == "full_attention"}

    @property
    def writers(self) -> int:
        """Layers with their own keys/values (and cache entry): all but the last num_kv_shared_layers."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def layer_shape(self, i: int) -> tuple[int, int]:
        """(head_dim, kv heads) of layer i."""
        over = self.per_layer_config.get(str(i), self.per_layer_config.get(i, {}))  # JSON keys are strings
        return over.get("head_dim", self.head_dim), over.get("num_key_value_heads", self.num_key_value_heads)

    def problems(self) -> list[str]:
        out = super().problems()
        if self.use_bidirectional_attention == "all":
            out.append("use_bidirectional_attention 'all' (non-causal text attention) is not supported")
        if not 0 <= self.num_kv_shared_layers < self.num_hidden_layers:
            out.append(f"num_kv_shared_layers ({self.num_kv_shared_layers}) must be < num_hidden_layers")
        elif set(self.layer_types[self.writers :]) - set(self.layer_types[: self.writers]):
            out.append("a KV-shared layer type has no earlier layer of that type to read keys/values from")
        if self.enable_moe_block and None in (self.num_experts, self.top_k_experts, self.moe_intermediate_size):
            out.append("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        heads = self.num_attention_heads
        out += [f"layer {i}: {heads} heads not a multiple of {kv} kv heads" for i in range(self.num_hidden_layers)
                if heads % (kv := self.layer_shape(i)[1])]  # fmt: skip
        return out


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, index: int, rotary: RotaryEmbedding, lm: Gemma4LM) -> None:
        super().__init__()
        d, eps, (head_dim, kv_heads) = cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_shape(index)
        kind, self.index, reader, self._lm = cfg.layer_types[index], index, index >= cfg.writers, [lm]
        self.self_attn = KVSharedAttention(
            d, cfg.num_attention_heads, kv_heads, head_dim, rotary=rotary, eps=eps, share=kind, reader=reader,
            k_eq_v=cfg.attention_k_eq_v and kind == "full_attention", bias=cfg.attention_bias,
        )  # fmt: skip
        wide = 2 if cfg.use_double_wide_mlp and reader else 1
        self.mlp = GatedMLP(d, cfg.intermediate_size * wide, cfg.hidden_activation)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", RMSNorm(d, eps, scale_in_float32=True))
        self.register_buffer("layer_scalar", torch.ones(1))
        c, p = cfg, cfg.hidden_size_per_layer_input
        moe = (c.num_experts, c.top_k_experts, c.moe_intermediate_size, c.hidden_activation, eps)
        self.moe = c.enable_moe_block and Gemma4MoEBranch(d, *moe)
        self.ple = p and PerLayerInput(d, p, cfg.hidden_activation, eps)

    def forward(self, h: torch.Tensor, layer: CacheLayer | None, step: StepInput) -> torch.Tensor:  # [B, T, D]
        a = self.self_attn(self.input_layernorm(h), layer, step)
        h, x = residual_norm(h, a, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        m = self.mlp(x) if not self.moe else self.moe(self.mlp(x), h)
        h = residual_norm(h, m, self.post_feedforward_layernorm, None)[0]
        if self.ple:
            h = self.ple(h, self._lm[0].per_layer_inputs(step)[:, :, self.index])
        return h * self.layer_scalar


@register_family("gemma4_text")
class Gemma4LM(StackLM):
    family = "gemma4"
    config_class = Gemma4Config

    def __init__(self, config) -> None:
        super().__init__(config)
        c = self.cfg
        if p := c.hidden_size_per_layer_input:  # HF keeps the PLE modules directly in model.*
            vocab = c.vocab_size_per_layer_input
            self.model.ple = PerLayerEmbeddings(vocab, c.hidden_size, c.num_hidden_layers, p, c.rms_norm_eps)

    def hf_name(self, name: str) -> str:  # the PLE and expert-branch modules' children sit in HF's parent module
        return name.replace(".ple.", ".").replace(".moe.", ".")

    def plan(self) -> list[str]:
        return self.cfg.layer_types

    def shared(self) -> dict[str, RotaryEmbedding]:
        """One rotary per layer type, over that type's head_dim."""
        c = self.cfg
        return {
            k: layer_rotary(c.to_dict(), c.rope_parameters[k], c.layer_shape(i)[0]) for i, k in enumerate(self.kinds)
        }

    def build_layer(self, kind: str, index: int, shared: dict[str, RotaryEmbedding]) -> Gemma4DecoderLayer:
        return Gemma4DecoderLayer(self.cfg, index, shared[kind], self)

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps, scale_in_float32=True)

    def native_layers(self) -> list[NativeLayer]:
        """The writers' caches only (readers hold none); a window on sliding layers only."""
        native, c = self.cfg.native_layers(self.dtype), self.cfg
        shape = [dict(zip(("head_dim", "num_kv_heads"), c.layer_shape(i), strict=True)) for i in range(c.writers)]
        return [NativeLayer(n.type, {**n.params, **s}) for n, s in zip(native, shape)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=h.dtype)

    def per_layer_inputs(self, step: StepInput) -> torch.Tensor:
        """The block's PLE [B, T, L, P], computed by the first layer that asks (from the block's token ids)."""
        if "gemma4_ple" not in step.memo:
            step.memo["gemma4_ple"] = self.model.ple(step.ids, self.embed(step.ids))
        return step.memo["gemma4_ple"]

    def forward_block(self, input_ids: torch.Tensor, cache: Cache, last_only: bool = False) -> torch.Tensor:
        step, h = cache.current_block, self.embed(input_ids)
        entries = [*cache.entries, *[None] * self.cfg.num_kv_shared_layers]  # readers have no cache entry
        for block, entry in zip(self.decoder_layers, entries, strict=True):
            h = block(h, entry, step)
        return self.head(h[:, -1:] if last_only else h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits, cap = super().head(h), self.cfg.final_logit_softcapping
        return cap * torch.tanh(logits / cap) if cap else logits
