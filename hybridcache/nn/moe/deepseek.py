"""DeepSeek-V3 mixture of experts (Kimi Linear's too): a sigmoid router with a score-correction bias and group-limited
top-k, routed weights renormalised and scaled, plus always-on shared experts. HF names: `gate` (weight [E, D],
buffer e_score_correction_bias [E]), `experts.E.{gate,up,down}_proj`, `shared_experts.{gate,up,down}_proj`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.nn.core.mlp import GatedMLP
from hybridcache.nn.moe.topk import SparseMoE


class GroupTopkRouter(nn.Module):
    """HF `DeepseekV3TopkRouter`: choose by sigmoid(logits) + bias within the best `topk_group` of `n_group` expert
    groups (a group scores the sum of its two best); weigh by the unbiased sigmoid scores."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int, **kw) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.normalize, self.scaling = kw.get("normalize", True), kw.get("routed_scaling_factor", 1.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [N, D] -> weights, index [N, k]
        acc = torch.promote_types(x.dtype, torch.float32)  # float32 as HF (float64 stays float64)
        scores = F.linear(x.to(acc), self.weight.to(acc)).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.to(acc)
        grouped = choice.view(x.shape[0], self.n_group, -1)  # [N, G, E / G]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1.0)
        choice = grouped.masked_fill(keep[..., None] == 0, float("-inf")).flatten(1)  # [N, E]
        index = choice.topk(self.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(1, index)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(x.dtype), index


class DeepseekMoE(SparseMoE):
    """SparseMoE's expert dispatch with the group-limited sigmoid router, plus shared experts (n_shared times the
    expert width; none when n_shared is 0)."""

    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, top_k: int, n_shared: int, act: str = "silu", **router
    ) -> None:
        nn.Module.__init__(self)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k = top_k
        self.gate = GroupTopkRouter(hidden, num_experts, top_k, **router)
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, act) for _ in range(num_experts))
        self.shared_experts = GatedMLP(hidden, intermediate * n_shared, act) if n_shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        out = super().forward(h)
        return out if self.shared_experts is None else out + self.shared_experts(h)
