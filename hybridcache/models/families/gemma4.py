"""Gemma 4 text: sliding and global attention (global layers: own head_dim / kv heads, keys as values with
`attention_k_eq_v`, proportional RoPE), q/k/v and sandwich norms, per-layer input embeddings (PLE), experts beside the
MLP (`enable_moe_block`), a per-layer output scalar. KV sharing: the last `num_kv_shared_layers` layers have no k/v
and no cache entry, they attend to what the last earlier layer of their type attended to in the block; the cache
holds the writers' entries only (at their own indices), so rollback / save / load are theirs."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridcache.cache import Cache, CacheLayer, NativeLayer
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.models.families.gemma4_config import Gemma4Config
from hybridcache.nn import GatedMLP, RMSNorm, RotaryEmbedding, StepInput, residual_norm
from hybridcache.nn.attention.kv_shared import KVSharedAttention, layer_rotary
from hybridcache.nn.core.per_layer_embeddings import PerLayerEmbeddings, PerLayerInput
from hybridcache.nn.moe.gemma4 import Gemma4MoEBranch


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
    final_norm_options = {"scale_in_float32": True}  # HF's Gemma4RMSNorm: weight times the float32 normed x

    def __init__(self, config) -> None:
        super().__init__(config)
        c = self.cfg
        if p := c.hidden_size_per_layer_input:  # HF keeps the PLE modules directly in model.*
            vocab = c.vocab_size_per_layer_input
            self.model.ple = PerLayerEmbeddings(vocab, c.hidden_size, c.num_hidden_layers, p, c.rms_norm_eps)

    def hf_name(self, name: str) -> str:  # the PLE and expert-branch modules' children sit in HF's parent module
        return name.replace(".ple.", ".").replace(".moe.", ".")

    def shared(self) -> dict[str, RotaryEmbedding]:
        """One rotary per layer type, over that type's head_dim."""
        c = self.cfg
        return {
            k: layer_rotary(c.to_dict(), c.rope_parameters[k], c.layer_shape(i)[0]) for i, k in enumerate(self.kinds)
        }

    def build_layer(self, kind: str, index: int, shared: dict[str, RotaryEmbedding]) -> Gemma4DecoderLayer:
        return Gemma4DecoderLayer(self.cfg, index, shared[kind], self)

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
