"""Gated MLPs whose gate and up projections are clamped before the product (GLM-5-Next's `swiglu_limit`):
down(act(min(gate, L)) * clamp(up, -L, L)); and DeepSeek-V3's MoE built from them (HF names as DeepseekMoE)."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.nn.core.mlp import GatedMLP
from hybridcache.nn.moe.deepseek import DeepseekMoE


class ClampedGatedMLP(GatedMLP):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu", limit: float = 10.0) -> None:
        super().__init__(hidden, intermediate, act)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(self.act(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit))


class ClampedDeepseekMoE(DeepseekMoE):
    """DeepseekMoE (group-limited sigmoid router, shared experts) with ClampedGatedMLP experts."""

    def __init__(self, hidden, intermediate, num_experts, top_k, n_shared, act="silu", *, limit, **router) -> None:
        super().__init__(hidden, intermediate, num_experts, top_k, n_shared, act, **router)
        self.experts = nn.ModuleList(ClampedGatedMLP(hidden, intermediate, act, limit) for _ in range(num_experts))
        if n_shared:
            self.shared_experts = ClampedGatedMLP(hidden, intermediate * n_shared, act, limit)
