"""The shape Mamba and Mamba2 share: embeddings -> pre-norm residual mixer blocks -> norm_f -> lm_head."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from hybridcache.cache import CacheLayer
from hybridcache.models.core.base import HybridLM
from hybridcache.models.core.family_config import FamilyConfig
from hybridcache.nn import RMSNorm, StepInput
from hybridcache.nn.core.pre_norm import PreNormLayer, PreNormParts


class ResidualMixerBlock(PreNormLayer):
    """h + mixer(norm(h)); the residual is kept in float32 when `residual_in_fp32`."""

    def __init__(self, hidden: int, eps: float, mixer: nn.Module, residual_in_fp32: bool) -> None:
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.norm = RMSNorm(hidden, eps)
        self.mixer = mixer

    def pre_norm_parts(self) -> PreNormParts:
        return PreNormParts(self.norm, self.mixer, None, None)

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        residual = h.float() if self.residual_in_fp32 else h
        return residual + self.mixer(self.norm(h.to(self.norm.weight.dtype)), layer, step)


class SSMBackbone(nn.Module):
    def __init__(self, cfg: Any, make_mixer: Callable[[Any], nn.Module]) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        self.embeddings = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            ResidualMixerBlock(d, eps, make_mixer(cfg), cfg.residual_in_fp32) for _ in range(cfg.num_hidden_layers)
        )
        self.norm_f = RMSNorm(d, eps)


class SSMLM(HybridLM):
    """Base of MambaLM / Mamba2LM: a family gives `config_class` (with layer_norm_epsilon and residual_in_fp32),
    `make_mixer(cfg)` (the typed config -> one mixer) and `native_layers()`."""

    config_class: ClassVar[type[FamilyConfig]]
    tied_weights = {"lm_head.weight": "backbone.embeddings.weight"}

    @staticmethod
    def make_mixer(cfg: Any) -> nn.Module:
        raise NotImplementedError

    def __init__(self, config: Mapping[str, Any] | FamilyConfig) -> None:
        cfg = self.config_class.from_hf(config)
        super().__init__(cfg.to_dict())
        self.cfg = cfg
        self.backbone = SSMBackbone(cfg, self.make_mixer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.backbone.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(input_ids)  # [B, T, D]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.backbone.norm_f(h).to(self.dtype))  # [B, T, V]

    def embed_head_parts(self) -> tuple | None:
        """(the embedding module, its multiplier 1.0, the final norm, lm_head) for a greedy C loop
        (accel/runs/embed_head.py; float32: the head's cast is then none), or None where they are computed otherwise."""
        cls = type(self)
        if cls.embed is not SSMLM.embed or cls.head is not SSMLM.head or self.dtype != torch.float32:
            return None
        return self.backbone.embeddings, 1.0, self.backbone.norm_f, self.lm_head
