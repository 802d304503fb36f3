"""Mamba2 language model: pre-norm Mamba2 mixer blocks (residual optionally in float32), final RMSNorm, LM head."""

from __future__ import annotations

from hybridcache.blocks.mamba2 import Mamba2Mixer
from hybridcache.cache import NativeLayer
from hybridcache.models.ssm_lm import SSMLM


class Mamba2LM(SSMLM):
    family = "mamba2"
    make_mixer = staticmethod(Mamba2Mixer.from_config)

    def native_layers(self) -> list[NativeLayer]:
        mixer: Mamba2Mixer = self.backbone.layers[0].mixer
        params = {"num_heads": mixer.num_heads, "head_dim": mixer.head_dim, "state_size": mixer.state_size,
                  "n_groups": mixer.n_groups, "conv_kernel": mixer.conv1d.kernel_size[0], "dtype": self.dtype}
        return [NativeLayer("mamba2", dict(params)) for _ in self.backbone.layers]
