"""Nemotron-H (NVIDIA): a layer pattern where every decoder layer is ONE pre-norm residual mixer.

`hybrid_override_pattern` (or `layers_block_type`) gives each layer's mixer: "M" Mamba2 (grouped gated RMSNorm),
"*" attention (no positional embedding), "-" a squared-ReLU MLP, "E" a mixture of squared-ReLU experts with a
DeepSeek-V3-style router (sigmoid scores, correction bias, group-limited top-k) plus a shared expert.

Caches: only Mamba2 and attention layers hold state, and a cache entry cannot be empty, so cache entry i belongs to
the i-th Mamba2/attention layer, which runs together with the MLP/MoE layers that follow it (layers before the
first such layer run with it too). `layers.<i>` in a cache config therefore counts Mamba2/attention layers only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.accel import register_accel
from hybridcache.accel.layers.mlp import MLPLayerAccel
from hybridcache.accel.layers.pre_norm import PreNormAccel
from hybridcache.accel.mixers.moe import latent_experts_accel
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.base import HybridLM
from hybridcache.models.core.family_config import FamilyConfig, param
from hybridcache.models.core.registry import register_family
from hybridcache.nn import AttentionMixer, RMSNorm, StepInput
from hybridcache.nn.core.mlp import activation
from hybridcache.nn.core.pre_norm import PreNormLayer, PreNormParts
from hybridcache.nn.recurrent.mamba2 import Mamba2Mixer

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' legacy layer type names
STATEFUL = ("linear_attention", "full_attention")


@dataclass(kw_only=True)
class NemotronHConfig(FamilyConfig):
    """HF NemotronHConfig (transformers 5) fields the model reads, with HF defaults and its legacy aliases
    (mamba_n_groups, mamba_d_conv, ...). The layer list comes from `layers_block_type`, else from
    `hybrid_override_pattern`; num_hidden_layers follows it (HF ignores a num_hidden_layers that disagrees)."""

    family: ClassVar[str] = "nemotron_h"
    num_hidden_layers: int | None = param(None, positive=True)
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    layers_block_type: list[str] | None = param(None, choices=(*PATTERN.values(), *LEGACY), aliases=("layer_types",))
    hybrid_override_pattern: str | None = None
    num_attention_heads: int = param(32, positive=True)
    num_key_value_heads: int | None = param(8, positive=True)
    head_dim: int = param(128, positive=True)
    intermediate_size: int = param(21504, positive=True)
    mlp_hidden_act: str = param("relu2", choices=("relu2", "relu", "silu", "gelu"))
    mlp_bias: bool = False
    ssm_state_size: int = param(128, positive=True)
    mamba_num_heads: int = param(128, positive=True)
    mamba_head_dim: int = param(64, positive=True)
    mamba_hidden_act: str = param("silu", choices=("silu", "swish"))
    n_groups: int = param(8, positive=True, aliases=("mamba_n_groups",))
    conv_kernel: int = param(4, positive=True, aliases=("mamba_d_conv",))
    chunk_size: int = param(128, positive=True, aliases=("mamba_chunk_size",))
    time_step_min: float = param(0.001, nonnegative=True, aliases=("mamba_dt_min",))
    use_conv_bias: bool = param(True, aliases=("mamba_conv_bias",))
    use_bias: bool = False
    n_routed_experts: int = param(8, positive=True, aliases=("num_local_experts",))
    num_experts_per_tok: int = param(2, positive=True)
    moe_intermediate_size: int = param(7688, positive=True)
    moe_shared_expert_intermediate_size: int = param(7688, positive=True)
    moe_latent_size: int | None = param(None, positive=True)
    routed_scaling_factor: float = param(1.0, positive=True)
    n_group: int = param(1, positive=True)
    topk_group: int = param(1, positive=True)
    norm_topk_prob: bool = True
    layer_norm_epsilon: float = param(1e-5, positive=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layers_block_type is not None:
            self.layers_block_type = [LEGACY.get(t, t) for t in self.layers_block_type]
        elif self.hybrid_override_pattern is not None:
            bad = sorted(set(self.hybrid_override_pattern) - set(PATTERN))
            if bad:
                raise ValueError(f"hybrid_override_pattern has unknown characters {bad} (known: M, *, -, E)")
            self.layers_block_type = [PATTERN[c] for c in self.hybrid_override_pattern]
        else:
            self.layers_block_type = ["linear_attention", "moe", "full_attention", "mlp"]  # HF's default
        self.num_hidden_layers = len(self.layers_block_type)

    def problems(self) -> list[str]:
        out, types = [], self.layers_block_type
        if not types:
            out.append("the layer list (layers_block_type / hybrid_override_pattern) is empty")
        elif not any(t in STATEFUL for t in types):
            out.append("there must be at least one Mamba2 ('M') or attention ('*') layer")
        if self.num_attention_heads % self.num_key_value_heads:
            out.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.mamba_num_heads % self.n_groups:
            out.append(f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of n_groups ({self.n_groups})")
        if "moe" in types:
            experts, groups = self.n_routed_experts, self.n_group
            if experts % groups or experts // groups < 2:
                out.append(
                    f"n_routed_experts ({experts}) must be a multiple of n_group ({groups}) with at least "
                    "2 experts per group (the router sums each group's top 2)"
                )
            if self.topk_group > groups:
                out.append(f"topk_group ({self.topk_group}) exceeds n_group ({groups})")
            if self.num_experts_per_tok > experts * min(self.topk_group, groups) // groups:
                out.append(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of the "
                    f"{self.topk_group} groups kept"
                )
        return out


class ReluSquaredMLP(nn.Module):
    """down_proj(act(up_proj(x))): Nemotron-H's ungated MLP (act: squared ReLU by default)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "relu2", bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act, self.act_name = activation(act), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3 routing (HF `NemotronHTopkRouter`, names weight / e_score_correction_bias), in float32 or wider.

    Scores are sigmoid(logits); the correction bias only steers the choice: groups ranked by the sum of their top
    2 biased scores, the best `topk_group` groups kept, the top-k experts of those; the weights are the unbiased
    scores of the chosen experts, renormalised (norm_topk_prob) and times routed_scaling_factor.
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        n_group: int = 1,
        topk_group: int = 1,
        normalize: bool = True,
        scaling: float = 1.0,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.num_experts, self.top_k, self.n_group, self.topk_group = num_experts, top_k, n_group, topk_group
        self.normalize, self.scaling = normalize, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [N, D]
        acc = torch.promote_types(x.dtype, torch.float32)
        scores = F.linear(x.to(acc), self.weight.to(acc)).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.to(acc)
        if self.topk_group < self.n_group:  # keep only the experts of the best groups
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)  # [N, G, E/G]
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # [N, G]
            kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1)[1], 1.0)
            choice = choice.masked_fill(~kept.bool()[..., None].expand_as(grouped).reshape_as(choice), -math.inf)
        index = choice.topk(self.top_k, dim=-1)[1]  # [N, k]
        weights = scores.gather(1, index)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, index


class NemotronHMoE(nn.Module):
    """Routed squared-ReLU experts (optionally in a latent space: fc1/fc2_latent_proj) + one shared expert.

    As in HF, routed outputs are weighted and summed in the router's precision (float32 or wider), then cast.
    """

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        d, act, bias = cfg.hidden_size, cfg.mlp_hidden_act, cfg.mlp_bias
        width = cfg.moe_latent_size or d
        self.gate = GroupLimitedRouter(
            d,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )
        self.experts = nn.ModuleList(
            ReluSquaredMLP(width, cfg.moe_intermediate_size, act) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = ReluSquaredMLP(d, cfg.moe_shared_expert_intermediate_size, act, bias)
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(d, width, bias=bias)
            self.fc2_latent_proj = nn.Linear(width, d, bias=bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        fast = self.__dict__.get("accel")  # hybridcache.accel's fast path (a decode token's experts), once installed
        if fast is not None:
            out = fast(h)
            if out is not None:
                return out
        x = h.reshape(-1, h.shape[-1])  # [N, D]
        weights, index = self.gate(x)  # [N, k] each
        if self.fc1_latent_proj is not None:
            x = self.fc1_latent_proj(x)
        out = torch.zeros(*x.shape, dtype=weights.dtype, device=x.device)  # [N, D']
        if torch.compiler.is_compiling():  # static shapes: every expert on every token, zero weight if not routed
            dense = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype, device=x.device)
            dense.scatter_(1, index, weights)  # [N, E]
            for e, expert in enumerate(self.experts):
                out = out + expert(x) * dense[:, e, None]
        else:
            for e in torch.unique(index).tolist():  # only experts that received tokens
                token, slot = torch.where(index == e)
                out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        out = out.to(h.dtype)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out.view_as(h) + self.shared_experts(h)


register_accel(NemotronHMoE, latent_experts_accel(NemotronHMoE))  # a decode token's routed experts, the same bits


class NemotronHBlock(PreNormLayer):
    """h + mixer(norm(h)) (HF names norm / mixer); the norm scales in float32 before casting back."""

    def __init__(self, cfg: NemotronHConfig, kind: str) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.kind = kind
        self.norm = RMSNorm(d, cfg.layer_norm_epsilon, scale_in_float32=True)
        if kind == "linear_attention":
            # HF clamps dt at time_step_min from below in the chunked scan (its decode step does not clamp; we
            # clamp both, so every split of a sequence agrees)
            self.mixer = Mamba2Mixer(
                d,
                cfg.mamba_num_heads,
                cfg.mamba_head_dim,
                cfg.ssm_state_size,
                cfg.n_groups,
                cfg.conv_kernel,
                cfg.chunk_size,
                use_conv_bias=cfg.use_conv_bias,
                use_bias=cfg.use_bias,
                time_step_limit=(cfg.time_step_min, math.inf),
                eps=cfg.layer_norm_epsilon,
                activation=cfg.mamba_hidden_act,
            )
        elif kind == "full_attention":  # no rotary; HF's projections have no bias whatever attention_bias says
            self.mixer = AttentionMixer(d, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        elif kind == "mlp":
            self.mixer = ReluSquaredMLP(d, cfg.intermediate_size, cfg.mlp_hidden_act, cfg.mlp_bias)
        else:
            self.mixer = NemotronHMoE(cfg)

    def pre_norm_parts(self) -> PreNormParts | None:  # a Mamba2 or attention block: a pre-norm layer with no MLP
        return PreNormParts(self.norm, self.mixer, None, None) if self.kind in STATEFUL else None

    def mlp_layer_parts(self) -> tuple | None:  # an MLP block: (norm, the MLP, up, down, activation name)
        if self.kind != "mlp" or type(self.mixer) is not ReluSquaredMLP:
            return None
        m = self.mixer
        return self.norm, m, m.up_proj, m.down_proj, m.act_name

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        x = self.norm(h.to(self.norm.weight.dtype))
        return h + (self.mixer(x, layer, step) if self.kind in STATEFUL else self.mixer(x))


def block_accel(block: NemotronHBlock) -> PreNormAccel:
    """An MLP block's record is hc_pre_norm_mlp's (accel/layers/mlp.py); a Mamba2 block's the pre-norm layer's."""
    return MLPLayerAccel(block) if block.kind == "mlp" else PreNormAccel(block)


register_accel(NemotronHBlock, block_accel)


class LayerRun:
    """The decoder layers that share one cache entry: a Mamba2/attention layer and the MLP/MoE layers around it."""

    def __init__(self, blocks: list[NemotronHBlock]) -> None:
        self.blocks = blocks

    def __call__(self, h: torch.Tensor, entry: CacheLayer, step: StepInput) -> torch.Tensor:
        for block in self.blocks:
            h = block(h, entry, step)
        return h


class NemotronHBackbone(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, kind) for kind in cfg.layers_block_type)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, scale_in_float32=True)


def layer_runs(types: list[str]) -> list[list[int]]:
    """Layer indices per cache entry: each Mamba2/attention layer with the stateless layers after it (the
    stateless layers before the first one join the first run)."""
    runs: list[list[int]] = []
    lead: list[int] = []
    for i, kind in enumerate(types):
        if kind in STATEFUL:
            runs.append(lead + [i])
            lead = []
        elif runs:
            runs[-1].append(i)
        else:
            lead.append(i)
    return runs


@register_family("nemotron_h")
class NemotronHLM(HybridLM):
    family = "nemotron_h"
    config_class = NemotronHConfig
    tied_weights = {"lm_head.weight": "backbone.embeddings.weight"}

    def __init__(self, config: Mapping[str, Any] | NemotronHConfig) -> None:
        cfg = self.config_class.from_hf(config)
        super().__init__(cfg.to_dict())
        self.cfg = cfg
        self.types = list(cfg.layers_block_type)
        self.backbone = NemotronHBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.runs = layer_runs(self.types)  # a plain list: the blocks stay registered under backbone.layers only
        self._layer_runs = [LayerRun([self.backbone.layers[i] for i in run]) for run in self.runs]

    def convert_checkpoint(self, state: dict) -> dict:
        """Drop multi-token-prediction heads (`mtp.*`, unused here, as in HF); accept the `model.` prefix of
        transformers' in-memory names for `backbone.`."""
        return {
            ("backbone." + k[len("model.") :] if k.startswith("model.") else k): v
            for k, v in state.items()
            if not k.startswith("mtp.")
        }

    def native_layers(self) -> list[NativeLayer]:
        c, out = self.cfg, []
        for run in self.runs:
            kind = next(self.types[i] for i in run if self.types[i] in STATEFUL)
            if kind == "full_attention":
                out.append(
                    NativeLayer(
                        "full", {"num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "dtype": self.dtype}
                    )
                )
            else:
                out.append(
                    NativeLayer(
                        "mamba2",
                        {
                            "num_heads": c.mamba_num_heads,
                            "head_dim": c.mamba_head_dim,
                            "state_size": c.ssm_state_size,
                            "n_groups": c.n_groups,
                            "conv_kernel": c.conv_kernel,
                            "dtype": self.dtype,
                        },
                    )
                )
        return out

    @property
    def decoder_layers(self) -> list[LayerRun]:  # type: ignore[override]
        return self._layer_runs

    def layers_forward(self, h: torch.Tensor, entries, step, blocks=None) -> torch.Tensor:
        """HybridLM's, with the fast path offered the blocks themselves, each with its run's cache entry."""
        runs = self.decoder_layers if blocks is None else blocks
        fast = self.fast_path
        if fast is not None:
            flat = [(block, entry) for run, entry in zip(runs, entries, strict=True) for block in run.blocks]
            out = fast.layers([b for b, _ in flat], [e for _, e in flat], h, step)
            if out is not None:
                return out
        for run, entry in zip(runs, entries, strict=True):
            h = run(h, entry, step)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(input_ids)  # [B, T, D]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.backbone.norm_f(h))  # [B, T, V]

    def embed_head_parts(self) -> tuple | None:
        """(the embedding, its multiplier 1.0, the final norm, lm_head) for a greedy C loop (accel/runs/embed_head.py),
        or None where a subclass computes them otherwise or the model is not float32."""
        cls = type(self)
        if cls.embed is not NemotronHLM.embed or cls.head is not NemotronHLM.head or self.dtype != torch.float32:
            return None
        return self.backbone.embeddings, 1.0, self.backbone.norm_f, self.lm_head
