"""Mamba2 language model: pre-norm Mamba2 mixer blocks (residual optionally in float32), final RMSNorm, LM head."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from hybridcache.cache import NativeLayer
from hybridcache.models.core.family_config import FamilyConfig, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.ssm_lm import SSMLM
from hybridcache.nn.recurrent.mamba2 import Mamba2Mixer


@dataclass(kw_only=True)
class Mamba2Config(FamilyConfig):
    """HF Mamba2Config (transformers 5) fields the model reads, with HF defaults."""

    family: ClassVar[str] = "mamba2"
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    num_heads: int = param(128, positive=True)
    head_dim: int = param(64, positive=True)
    state_size: int = param(128, positive=True)
    expand: int = param(2, positive=True)
    conv_kernel: int = param(4, positive=True)
    n_groups: int = param(8, positive=True)
    chunk_size: int = param(256, positive=True)
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    layer_norm_epsilon: float = param(1e-5, positive=True)
    residual_in_fp32: bool = True
    time_step_rank: int | str = param("auto", positive=True)
    time_step_limit: list[float] = param([0.0, math.inf], nonnegative=True)
    rms_norm: bool = True
    norm_before_gate: bool = False

    def problems(self) -> list[str]:
        out = []
        if self.expand * self.hidden_size != self.num_heads * self.head_dim:
            out.append(
                f"expand * hidden_size ({self.expand * self.hidden_size}) must equal num_heads * head_dim "
                f"({self.num_heads * self.head_dim})"
            )
        if self.num_heads % self.n_groups:
            out.append(f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")
        if len(self.time_step_limit) != 2 or self.time_step_limit[0] > self.time_step_limit[1]:
            out.append(f"time_step_limit must be [min, max] with min <= max, got {self.time_step_limit!r}")
        if isinstance(self.time_step_rank, str) and self.time_step_rank != "auto":
            out.append(f"time_step_rank must be a positive int or 'auto', got {self.time_step_rank!r}")
        return out


@register_family("mamba2")
class Mamba2LM(SSMLM):
    family = "mamba2"
    config_class = Mamba2Config

    @staticmethod
    def make_mixer(cfg: Mamba2Config) -> Mamba2Mixer:
        return Mamba2Mixer.from_config(cfg.to_dict())  # the block reads HF's Mamba2 names

    def native_layers(self) -> list[NativeLayer]:
        mixer: Mamba2Mixer = self.backbone.layers[0].mixer
        params = {
            "num_heads": mixer.num_heads,
            "head_dim": mixer.head_dim,
            "state_size": mixer.state_size,
            "n_groups": mixer.n_groups,
            "conv_kernel": mixer.conv1d.kernel_size[0],
            "dtype": self.dtype,
        }
        return [NativeLayer("mamba2", dict(params)) for _ in self.backbone.layers]
