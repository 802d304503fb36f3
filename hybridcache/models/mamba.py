"""Mamba (v1) language model: pre-norm Mamba mixer blocks, optionally with a float32 residual stream."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.blocks import RMSNorm, StepInput
from hybridcache.blocks.mamba import MambaMixer, resolve_dt_rank
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.base import HybridLM

# HF MambaConfig defaults for keys a config.json may leave out.
DEFAULTS = {
    "state_size": 16, "expand": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
    "hidden_act": "silu", "layer_norm_epsilon": 1e-5, "residual_in_fp32": True, "time_step_rank": "auto",
    "tie_word_embeddings": True,
}


def intermediate_size(config: dict) -> int:
    return int(config.get("intermediate_size") or config["expand"] * config["hidden_size"])


class MambaBlock(nn.Module):
    """h + mixer(norm(h)); the residual is kept in float32 when `residual_in_fp32`."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        d = config["hidden_size"]
        self.residual_in_fp32 = bool(config["residual_in_fp32"])
        self.norm = RMSNorm(d, config["layer_norm_epsilon"])
        self.mixer = MambaMixer(
            d, intermediate_size(config), config["state_size"], config["conv_kernel"],
            resolve_dt_rank(config["time_step_rank"], d), conv_bias=config["use_conv_bias"],
            proj_bias=config["use_bias"], activation=config["hidden_act"],
        )

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        residual = h.float() if self.residual_in_fp32 else h
        return residual + self.mixer(self.norm(h.to(self.norm.weight.dtype)), layer, step)


class MambaBackbone(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(MambaBlock(config) for _ in range(config["num_hidden_layers"]))
        self.norm_f = RMSNorm(config["hidden_size"], config["layer_norm_epsilon"])


class MambaLM(HybridLM):
    family = "mamba"
    tied_weights = {"lm_head.weight": "backbone.embeddings.weight"}

    def __init__(self, config: dict) -> None:
        super().__init__({**DEFAULTS, **{k: v for k, v in config.items() if v is not None}})
        self.backbone = MambaBackbone(self.config)
        self.lm_head = nn.Linear(self.config["hidden_size"], self.config["vocab_size"], bias=False)

    def native_layers(self) -> list[NativeLayer]:
        c = self.config
        params = {"intermediate_size": intermediate_size(c), "state_size": c["state_size"],
                  "conv_kernel": c["conv_kernel"], "dtype": self.dtype}
        return [NativeLayer("mamba", params) for _ in range(c["num_hidden_layers"])]

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.backbone.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(input_ids)  # [B, T, D]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.backbone.norm_f(h).to(self.lm_head.weight.dtype))  # [B, T, V]
