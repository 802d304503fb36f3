"""Config pieces several families share, declared once with HF's names: a family config inherits the pieces it
has (`class BambaConfig(AttentionFields, Mamba2Fields)`) and re-declares only the fields whose HF default differs.

Each piece resolves its own derived values (`__post_init__`) and checks its own fields (`problems()`, chained
through `super()`), so a family's `problems()` starts from `super().problems()` and adds what is its alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from hybridcache.models.core.family_config import FamilyConfig, attention_problems, param
from hybridcache.nn.attention.rotary import RotaryEmbedding, rope_frequencies
from hybridcache.nn.recurrent.mamba import resolve_dt_rank


@dataclass(kw_only=True)
class AttentionFields(FamilyConfig):
    """Grouped-query attention with rotary embeddings. num_key_value_heads None = num_attention_heads (as HF);
    head_dim None = hidden_size // num_attention_heads; `rope_parameters` wins over the older `rope_theta`."""

    num_attention_heads: int = param(32, positive=True)
    num_key_value_heads: int | None = param(None, positive=True)
    head_dim: int | None = param(None, positive=True)
    attention_bias: bool = False
    max_position_embeddings: int = param(2048, positive=True)
    rope_parameters: dict | None = None
    rope_theta: float = param(10_000.0, positive=True)
    rms_norm_eps: float = param(1e-6, positive=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    # what a family's HF config fills in when rope_parameters leave it out (Bamba: partial_rotary_factor 0.5)
    rope_defaults: ClassVar[dict[str, Any]] = {}

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def problems(self) -> list[str]:
        return super().problems() + attention_problems(self)

    def rope(self) -> dict[str, Any]:
        """The rope parameters as HF resolves them: rope_parameters win (a legacy "type" names the rope_type), then
        rope_theta, then the family's `rope_defaults`."""
        params = dict(self.rope_parameters or {})
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", self.rope_theta)
        return {**self.rope_defaults, **params}

    def rotary(self) -> RotaryEmbedding:
        """The rotary embedding over the first head_dim * partial_rotary_factor channels of each head."""
        rope = self.rope()
        rotary_dim = int(self.attention_head_dim * rope.get("partial_rotary_factor", 1.0))
        return RotaryEmbedding(*rope_frequencies(self.to_dict(), rope, rotary_dim))

    def attention_mixer_args(self) -> dict[str, Any]:
        """AttentionMixer's arguments from these fields (attention_bias on the q/k/v and the output projections)."""
        return dict(
            hidden=self.hidden_size,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.attention_head_dim,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
        )


@dataclass(kw_only=True)
class MambaFields(FamilyConfig):
    """A Mamba (v1, selective scan) mixer in the `mamba_*` names of HF's Jamba and Zamba; mamba_dt_rank "auto" =
    ceil(hidden_size / 16) (`mamba_rank`)."""

    mamba_d_state: int = param(16, positive=True)
    mamba_d_conv: int = param(4, positive=True)
    mamba_expand: int = param(2, positive=True)
    mamba_dt_rank: int | str = param("auto", positive=True)
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba_rank(self) -> int:
        return resolve_dt_rank(self.mamba_dt_rank, self.hidden_size)

    def problems(self) -> list[str]:
        out = super().problems()
        if isinstance(self.mamba_dt_rank, str) and self.mamba_dt_rank != "auto":
            out.append(f"mamba_dt_rank must be a positive int or 'auto', got {self.mamba_dt_rank!r}")
        return out

    def mamba_cache_params(self) -> dict:
        """The native `mamba` cache layer's shape parameters (dtype added by the model)."""
        return {
            "intermediate_size": self.mamba_intermediate,
            "state_size": self.mamba_d_state,
            "conv_kernel": self.mamba_d_conv,
        }


@dataclass(kw_only=True)
class Mamba2Fields(FamilyConfig):
    """A Mamba2 (SSD) mixer in the `mamba_*` names of HF's Bamba lineage (Bamba, FalconH1, GraniteMoeHybrid).
    mamba_d_head "auto" = the mixer's inner width // mamba_n_heads; a family whose inner width is not
    mamba_expand * hidden_size (FalconH1's mamba_d_ssm) overrides `mamba_intermediate`."""

    mamba_n_heads: int = param(128, positive=True)
    mamba_d_head: int | str = param("auto", positive=True)
    mamba_n_groups: int = param(1, positive=True)
    mamba_d_state: int = param(256, positive=True)
    mamba_d_conv: int = param(4, positive=True)
    mamba_expand: int = param(2, positive=True)
    mamba_chunk_size: int = param(256, positive=True)
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: list[float] = param([0.0, math.inf], nonnegative=True)

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_expand * self.hidden_size

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mamba_d_head == "auto":
            self.mamba_d_head = self.mamba_intermediate // self.mamba_n_heads

    def problems(self) -> list[str]:
        out = super().problems()
        if isinstance(self.mamba_d_head, str):
            out.append(f"mamba_d_head must be a positive int or 'auto', got {self.mamba_d_head!r}")
        elif self.mamba_d_head * self.mamba_n_heads != self.mamba_intermediate:
            out.append(
                f"mamba_n_heads * mamba_d_head ({self.mamba_n_heads * self.mamba_d_head}) must equal the mamba "
                f"intermediate size ({self.mamba_intermediate})"
            )
        if self.mamba_n_heads % self.mamba_n_groups:
            out.append(
                f"mamba_n_heads ({self.mamba_n_heads}) must be a multiple of mamba_n_groups ({self.mamba_n_groups})"
            )
        if len(self.time_step_limit) != 2 or self.time_step_limit[0] > self.time_step_limit[1]:
            out.append(f"time_step_limit must be [min, max] with min <= max, got {self.time_step_limit!r}")
        return out

    def mamba2_mixer_args(self) -> dict:
        """Mamba2Mixer's shape arguments (hybridcache/nn/recurrent/mamba2.py); the family adds its norm and
        activation."""
        return {
            "hidden": self.hidden_size,
            "num_heads": self.mamba_n_heads,
            "head_dim": self.mamba_d_head,
            "state_size": self.mamba_d_state,
            "n_groups": self.mamba_n_groups,
            "conv_kernel": self.mamba_d_conv,
            "chunk_size": self.mamba_chunk_size,
            "use_conv_bias": self.mamba_conv_bias,
            "use_bias": self.mamba_proj_bias,
            "time_step_limit": tuple(self.time_step_limit),
        }

    def mamba2_cache_params(self) -> dict:
        """The native `mamba2` cache layer's shape parameters (dtype added by the model)."""
        return {
            "num_heads": self.mamba_n_heads,
            "head_dim": self.mamba_d_head,
            "state_size": self.mamba_d_state,
            "n_groups": self.mamba_n_groups,
            "conv_kernel": self.mamba_d_conv,
        }


@dataclass(kw_only=True)
class MoEFields(FamilyConfig):
    """Routed experts: how many (HF calls it num_local_experts, num_experts or n_routed_experts by family; 0 = no
    routed experts) and how many each token uses."""

    num_local_experts: int = param(8, nonnegative=True, aliases=("num_experts", "n_routed_experts"))
    num_experts_per_tok: int = param(2, positive=True)

    def problems(self) -> list[str]:
        out = super().problems()
        if self.num_local_experts and self.num_experts_per_tok > self.num_local_experts:
            out.append(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_local_experts ({self.num_local_experts})"
            )
        return out
