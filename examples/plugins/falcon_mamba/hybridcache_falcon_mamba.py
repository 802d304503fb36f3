"""Falcon-Mamba (HF `model_type` "falcon_mamba") as a hybridcache family plugin: no edit to hybridcache needed.

Falcon-Mamba is Mamba (v1) with weightless RMS norms on the SSM inputs dt, B and C (HF's
FalconMambaWeightlessRMSNorm, eps = `mixer_rms_eps`): everything else, the cache type included ("mamba": conv +
SSM state), is Mamba's, so the family subclasses the in-tree Mamba config, mixer and model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hybridcache.models.core.family_config import param
from hybridcache.models.core.registry import register_family
from hybridcache.models.families.mamba import MambaConfig, MambaLM
from hybridcache.nn.core.linear import linear
from hybridcache.nn.recurrent.mamba import MambaMixer


@dataclass(kw_only=True)
class FalconMambaConfig(MambaConfig):
    """HF FalconMambaConfig (transformers 5): Mamba's fields plus the eps of the dt/B/C norms."""

    family: ClassVar[str] = "falcon_mamba"
    mixer_rms_eps: float = param(1e-6, positive=True)


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in at least float32 (HF: x.float(), then back to x's dtype)."""
    x32 = x if x.dtype == torch.float64 else x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class FalconMambaMixer(MambaMixer):
    """Mamba's mixer; dt, B and C are RMS-normalised (no weights, so nothing to load) before the scan."""

    def __init__(self, *args, rms_eps: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rms_eps = rms_eps

    def _ssm_inputs(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dt, b, c = self.x_proj(u).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        dt, b, c = (weightless_rms_norm(v, self.rms_eps) for v in (dt, b, c))  # [B, T, R], [B, T, N], [B, T, N]
        return linear(dt, self.dt_proj.weight, None, self.dt_proj._buffers.get("scale")), b, c  # bias: in softplus


@register_family("falcon_mamba")
class FalconMambaLM(MambaLM):
    family = "falcon_mamba"
    config_class = FalconMambaConfig

    @staticmethod
    def make_mixer(cfg: FalconMambaConfig) -> FalconMambaMixer:
        return FalconMambaMixer(**cfg.mixer_args(), rms_eps=cfg.mixer_rms_eps)
