"""Mamba2 language model: pre-norm Mamba2 mixer blocks (residual optionally in float32), final RMSNorm, LM head."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.blocks import RMSNorm, StepInput
from hybridcache.blocks.mamba2 import Mamba2Mixer
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.base import HybridLM


class Mamba2Block(nn.Module):
    """h + mixer(norm(h)); the residual is kept in float32 when `residual_in_fp32`."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.residual_in_fp32 = config.get("residual_in_fp32", True)
        self.norm = RMSNorm(config["hidden_size"], config.get("layer_norm_epsilon", 1e-5))
        self.mixer = Mamba2Mixer.from_config(config)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        residual = h.float() if self.residual_in_fp32 else h
        return residual + self.mixer(self.norm(h.to(self.norm.weight.dtype)), layer, step)


class Mamba2Backbone(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(Mamba2Block(config) for _ in range(config["num_hidden_layers"]))
        self.norm_f = RMSNorm(config["hidden_size"], config.get("layer_norm_epsilon", 1e-5))


class Mamba2LM(HybridLM):
    family = "mamba2"
    tied_weights = {"lm_head.weight": "backbone.embeddings.weight"}

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.backbone = Mamba2Backbone(config)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)

    def native_layers(self) -> list[NativeLayer]:
        mixer: Mamba2Mixer = self.backbone.layers[0].mixer
        params = {"num_heads": mixer.num_heads, "head_dim": mixer.head_dim, "state_size": mixer.state_size,
                  "n_groups": mixer.n_groups, "conv_kernel": mixer.conv1d.kernel_size[0], "dtype": self.dtype}
        return [NativeLayer("mamba2", dict(params)) for _ in self.backbone.layers]

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.backbone.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(input_ids)  # [B, T, D]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.backbone.norm_f(h)
        return self.lm_head(h.to(self.lm_head.weight.dtype))  # [B, T, V]
