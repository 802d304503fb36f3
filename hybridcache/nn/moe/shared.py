"""Sparse MoE with an always-on shared expert behind a sigmoid gate (Qwen2-MoE / Qwen3-Next style)."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.nn.core.mlp import GatedMLP
from hybridcache.nn.moe.topk import SparseMoE


class SharedExpertMoE(SparseMoE):
    """`SparseMoE` (softmax top-k router, experts.E.{gate,up,down}_proj) + sigmoid(shared_expert_gate(x)) *
    shared_expert(x). HF calls the router `gate`: a family maps that name in `hf_name`."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        shared_intermediate: int,
        act: str = "silu",
        normalize: bool = True,
    ) -> None:
        super().__init__(hidden, intermediate, num_experts, top_k, act, normalize)
        self.shared_expert = GatedMLP(hidden, shared_intermediate, act)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        routed = super().forward(h)
        return routed + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
