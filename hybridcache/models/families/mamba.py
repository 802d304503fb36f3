"""Mamba (v1) language model: pre-norm Mamba mixer blocks, optionally with a float32 residual stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hybridcache.cache import NativeLayer
from hybridcache.models.core.family_config import FamilyConfig, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.core.ssm_lm import SSMLM
from hybridcache.nn.recurrent.mamba import MambaMixer, resolve_dt_rank


@dataclass(kw_only=True)
class MambaConfig(FamilyConfig):
    """HF MambaConfig (transformers 5) fields the model reads, with HF defaults."""

    family: ClassVar[str] = "mamba"
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    state_size: int = param(16, positive=True)
    expand: int = param(2, positive=True)
    intermediate_size: int | None = param(None, positive=True)  # None: expand * hidden_size (as HF)
    conv_kernel: int = param(4, positive=True)
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    layer_norm_epsilon: float = param(1e-5, positive=True)
    residual_in_fp32: bool = True
    time_step_rank: int | str = param("auto", positive=True)  # "auto": ceil(hidden_size / 16)

    def problems(self) -> list[str]:
        if isinstance(self.time_step_rank, str) and self.time_step_rank != "auto":
            return [f"time_step_rank must be a positive int or 'auto', got {self.time_step_rank!r}"]
        return []

    def mixer_args(self) -> dict:
        """MambaMixer's arguments (hybridcache/nn/recurrent/mamba.py)."""
        return {
            "hidden": self.hidden_size,
            "intermediate": self.inner_size,
            "state_size": self.state_size,
            "conv_kernel": self.conv_kernel,
            "dt_rank": resolve_dt_rank(self.time_step_rank, self.hidden_size),
            "conv_bias": self.use_conv_bias,
            "proj_bias": self.use_bias,
            "activation": self.hidden_act,
        }

    @property
    def inner_size(self) -> int:
        return self.intermediate_size or self.expand * self.hidden_size


@register_family("mamba")
class MambaLM(SSMLM):
    family = "mamba"
    config_class = MambaConfig

    @staticmethod
    def make_mixer(cfg: MambaConfig) -> MambaMixer:
        return MambaMixer(**cfg.mixer_args())

    def native_layers(self) -> list[NativeLayer]:
        c = self.cfg
        params = {"intermediate_size": c.inner_size, "state_size": c.state_size, "conv_kernel": c.conv_kernel}
        return [NativeLayer("mamba", {**params, "dtype": self.dtype}) for _ in range(c.num_hidden_layers)]
