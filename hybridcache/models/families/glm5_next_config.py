"""GLM-5-Next's typed configs: HF Glm5NextTextConfig's fields (model_type glm5_next_text) and the composite
glm5_next config.json (text fields under text_config, or flat)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from hybridcache.models.core.family_config import length_problem, param
from hybridcache.models.families.kimi_linear import KimiLinearConfig


@dataclass(kw_only=True)
class Glm5NextConfig(KimiLinearConfig):
    """HF Glm5NextTextConfig's fields (Kimi Linear's MLA / KDA / MoE ones plus the DSA indexer and mHC)."""

    family: ClassVar[str] = "glm5_next_text"
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    vocab_size: int = param(154880, positive=True)
    hidden_size: int = param(4096, positive=True)
    intermediate_size: int = param(12288, positive=True)
    moe_intermediate_size: int = param(2048, positive=True)
    num_hidden_layers: int = param(45, positive=True)
    num_attention_heads: int = param(64, positive=True)
    num_key_value_heads: int | None = param(64, positive=True)
    num_local_experts: int = param(288, nonnegative=True, aliases=("num_experts", "n_routed_experts"))
    routed_scaling_factor: float = param(2.5, positive=True)
    q_lora_rank: int = param(1536, positive=True)
    qk_nope_head_dim: int = param(256, positive=True)
    qk_rope_head_dim: int = param(0, choices=(0,))  # NoPE
    head_dim: int | None = param(0, nonnegative=True)  # HF saves qk_rope_head_dim here (0); unused
    v_head_dim: int = param(256, positive=True)
    linear_num_heads: int = param(64, positive=True)
    linear_lower_bound: float | None = -5.0
    layer_types: list[str] | None = param(None, choices=("indexed_attention", "linear_attention", "full_attention"))
    indexer_types: list[str] | None = param(None, choices=("full", "shared"))
    index_topk: int = param(2048, positive=True)
    index_head_dim: int = param(128, positive=True)
    index_n_heads: int = param(32, positive=True)
    index_kpool: int = param(16, positive=True)
    swiglu_limit: float = param(10.0, positive=True)
    hc_mult: int = param(4, positive=True)
    hc_eps: float = param(1e-6, positive=True)
    hc_sinkhorn_iters: int = param(20, positive=True)
    index_kpool_always_select_tail: bool = param(True, choices=(True,))

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
        self.layer_types = ["indexed_attention" if t == "full_attention" else t for t in self.layer_types]
        self.first_k_dense_replace = min(3, n)
        super().__post_init__()
        self.indexer_types = self.indexer_types or ["full"] * n  # HF's default schedule: every layer runs it

    def problems(self) -> list[str]:
        out = super().problems()
        out += [p for p in [length_problem("indexer_types", self.indexer_types, self.num_hidden_layers)] if p]
        if self.index_topk % self.index_kpool:
            out.append(f"index_topk ({self.index_topk}) must be a multiple of index_kpool ({self.index_kpool})")
        for i, t in enumerate(self.layer_types):
            shared = t == "indexed_attention" and self.indexer_types[i] == "shared"
            if shared and (i == 0 or self.kinds[i - 1] != "full"):
                out.append(f"layer {i} shares top-k pools, but layer {i - 1} is no indexed layer running its indexer")
        return out

    @property
    def kinds(self) -> list[str]:  # per layer: linear | full (runs its indexer) | shared
        types = self.layer_types or []
        return [t if t == "linear_attention" else self.indexer_types[i] for i, t in enumerate(types)]


@dataclass(kw_only=True)
class Glm5NextCompositeConfig(Glm5NextConfig):
    """A glm5_next config.json: the text fields under text_config (or flat, as HF reads them)."""

    family: ClassVar[str] = "glm5_next"

    @classmethod
    def from_hf(cls, config, family=None, source=None):
        if isinstance(config, Mapping) and isinstance(config.get("text_config"), Mapping):
            outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
            config = {**config["text_config"], **outer}  # the outer keys (architectures, tying) as HF reads them
        return super().from_hf(config, family, source)
