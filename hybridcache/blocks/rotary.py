"""Rotary position embeddings: half-split ("rotate_half") or interleaved pairs, optionally on part of the head."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn


def rope_frequencies(hf_config: Mapping[str, Any], params: Mapping[str, Any], rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] and the cos/sin scaling for one `rope_parameters` entry.

    The default type is computed here; scaled types (linear, llama3, yarn, ...) use transformers' own
    initialisers so real checkpoints get exactly their reference frequencies.
    """
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (base ** exponents), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type '{rope_type}' (supported: default, {', '.join(ROPE_INIT_FUNCTIONS)})")
    cfg = AutoConfig.for_model(**{**hf_config, "rope_parameters": dict(params)})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` features of q and k [B, H, T, D] by position."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0, interleaved: bool = False) -> None:
        super().__init__()
        self.inv_freq = inv_freq.float()  # a plain attribute: model.to(bfloat16) must not round the frequencies
        self.scaling, self.interleaved = scaling, interleaved
        self.rotary_dim = 2 * inv_freq.numel()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq.to(positions.device)  # [B, T, R/2]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)  # [B, T, R]: pairs (0, 1), (2, 3), ...
        else:
            angles = torch.cat([angles, angles], dim=-1)  # [B, T, R]: halves
        cos, sin = angles.cos() * self.scaling, angles.sin() * self.scaling
        return cos[:, None].to(dtype), sin[:, None].to(dtype)  # [B, 1, T, R]

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        r = self.rotary_dim

        def apply(x: torch.Tensor) -> torch.Tensor:
            rot, rest = x[..., :r], x[..., r:]
            return torch.cat([rot * cos + self._rotate(rot) * sin, rest], dim=-1)

        return apply(q), apply(k)
