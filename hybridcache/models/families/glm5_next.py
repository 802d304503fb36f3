"""GLM-5-Next (GLM-5.3-Flash text model): hyper-connections (hc_mult residual streams mixed around every branch),
KDA linear attention (Kimi's, with the bounded "safe" decay) and DeepSeek sparse attention (MLA without RoPE whose
queries see the k-pools an indexer picks; "shared" layers reuse the previous layer's pick), DeepSeek-V3 MoE or dense
MLPs with clamped SwiGLU. Caches: `gated_delta` for KDA; for an indexed layer a group of `full` caches, `attention`
(MLA keys / values, padded to one head width) and `indexer` (its per-token keys and pool gates); a shared layer has
only `attention`. Registered under the text config's model_type and the composite one (text_config, weights under
model.language_model; the vision tower is dropped)."""

from __future__ import annotations

import re

import torch
from torch import nn

from hybridcache.accel import register_accel
from hybridcache.accel.mixers.delta import KDA, KDA_BOUNDED, delta_accel
from hybridcache.cache import NativeGroup, NativeLayer
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.stack import StackLM
from hybridcache.models.families.glm5_next_config import Glm5NextCompositeConfig, Glm5NextConfig
from hybridcache.models.families.kimi_linear import MLA_DIMS
from hybridcache.nn import RMSNorm, StepInput
from hybridcache.nn.attention.dsa import DSAMixer
from hybridcache.nn.core.clamped_mlp import ClampedDeepseekMoE, ClampedGatedMLP
from hybridcache.nn.core.hyper_connection import HyperConnection, hyper_merge
from hybridcache.nn.recurrent.kda import BailingDeltaAttention, KimiDeltaAttention


class Glm5DeltaAttention(KimiDeltaAttention):
    """Kimi's KDA (low-rank forget / output gates) with A_log per head and Bailing's bounded decay."""

    _gates = BailingDeltaAttention._gates

    def __init__(self, hidden: int, num_heads: int, head_dim: int, conv: int, eps: float, bound: float | None):
        super().__init__(hidden, num_heads, head_dim, conv, eps)
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.safe_gate, self.lower_bound = bound is not None, bound


def _delta_form(mixer: Glm5DeltaAttention):
    """Kimi's projections, the bounded decay where it has a bound (a named function: the accel holds it)."""
    return KDA_BOUNDED if mixer.safe_gate else KDA


# its decode step in one C call (accel/mixers/delta.py)
register_accel(Glm5DeltaAttention, delta_accel(Glm5DeltaAttention, _delta_form))


class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, kind: str, sparse: bool, relay: dict) -> None:
        super().__init__()
        self.relay = relay  # one block's selection, from an indexed layer to the shared layer right after it
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        if kind == "linear_attention":
            kda = (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim, eps, cfg.linear_lower_bound)
            self.self_attn: nn.Module = Glm5DeltaAttention(d, *kda)
        else:
            index = dict(heads=cfg.index_n_heads, head_dim=cfg.index_head_dim, topk=cfg.index_topk)
            mla = {k: getattr(cfg, k) for k in MLA_DIMS if k != "qk_rope_head_dim"}
            index = {**index, "kpool": cfg.index_kpool} if kind == "full" else None
            self.self_attn = DSAMixer(d, cfg.num_attention_heads, index=index, eps=eps, **mla)
        act, limit = cfg.hidden_act, cfg.swiglu_limit
        if sparse:
            router = {k: getattr(cfg, k) for k in ("n_group", "topk_group", "routed_scaling_factor")}
            moe = (cfg.moe_intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.n_shared_experts)
            self.mlp: nn.Module = ClampedDeepseekMoE(d, *moe, act, limit=limit, normalize=cfg.norm_topk_prob, **router)
        else:
            self.mlp = ClampedGatedMLP(d, cfg.intermediate_size, act, limit)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)
        hc = (d, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)

    def forward(self, h: torch.Tensor, entry, step: StepInput) -> torch.Tensor:  # h [B, T, N, D]
        relay = self.relay
        post, comb, x = self.attn_hc(h)
        x = self.input_layernorm(x)
        if isinstance(self.self_attn, DSAMixer):  # the selection goes on to the next layer only (as HF's)
            x, relay["selection"] = self.self_attn(x, entry, step, relay.pop("selection", None))
        else:
            x = self.self_attn(x, entry, step)
            relay.pop("selection", None)
        h = hyper_merge(post, comb, x, h)
        post, comb, x = self.ffn_hc(h)
        return hyper_merge(post, comb, self.mlp(self.post_attention_layernorm(x)), h)


_RENAMES = [(r"^model\.language_model\.", "model."), (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2")]


@register_family("glm5_next_text")
class Glm5NextLM(StackLM):
    family = "glm5_next_text"
    config_class = Glm5NextConfig

    def plan(self) -> list[str]:
        return self.cfg.kinds

    def shared(self) -> dict:  # the relay of one block's selection from an indexed layer to a shared one
        return {}

    def build_layer(self, kind: str, index: int, shared: dict) -> Glm5NextDecoderLayer:
        return Glm5NextDecoderLayer(self.cfg, kind, self.cfg.mlp_layer_types[index] == "sparse", shared)

    def final_norm(self) -> RMSNorm:
        return RMSNorm(self.cfg.hidden_size, self.cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> N copies of the embedding [B, T, N, D]
        return self.model.embed_tokens(input_ids).unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()

    def head(self, h: torch.Tensor) -> torch.Tensor:  # the streams' plain mean, then the final norm and lm_head
        return super().head(h.mean(2))

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in state.items():
            if not k.startswith(("model.visual.", "model.language_model.layers.45.")) and ".shared_head." not in k:
                out[re.sub(*_RENAMES[1], re.sub(*_RENAMES[0], k))] = v
        return out

    def native_layers(self) -> list[NativeLayer | NativeGroup]:
        c, dtype = self.cfg, self.dtype
        width = max(c.qk_nope_head_dim, c.v_head_dim)  # the MLA cache's padded head width
        h, d = c.linear_num_heads, c.linear_head_dim
        delta = dict(num_k_heads=h, num_v_heads=h, head_k_dim=d, head_v_dim=d, conv_kernel=c.linear_conv_kernel_dim)
        attn = NativeLayer("full", {"num_kv_heads": c.num_attention_heads, "head_dim": width, "dtype": dtype})
        index = NativeLayer("full", {"num_kv_heads": 1, "head_dim": c.index_head_dim, "dtype": dtype})
        kinds = {"linear_attention": NativeLayer("gated_delta", {**delta, "dtype": dtype}), "shared": attn}
        return [kinds.get(k) or NativeGroup({"attention": attn, "indexer": index}) for k in self.kinds]


@register_family("glm5_next")
class Glm5NextCompositeLM(Glm5NextLM):
    """The same model from a composite checkpoint (weights under model.language_model; the vision tower is dropped)."""

    family = "glm5_next"
    config_class = Glm5NextCompositeConfig
