"""Llama4 mixture of experts: sigmoid top-k router, fused experts, and an always-on shared expert.

The router score multiplies the expert's INPUT (not its output); the shared expert sees the raw input.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.nn.core.mlp import GatedMLP, activation


class Llama4Experts(nn.Module):
    """E gated experts with fused weights, HF layout: gate_up_proj [E, D, 2I] (gate | up), down_proj [E, I, D]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, intermediate, hidden))
        self.act = activation(act)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # x [N, D] -> [N, D]
        gate, up = (x @ self.gate_up_proj[e]).chunk(2, dim=-1)  # [N, I] each
        return (up * self.act(gate)) @ self.down_proj[e]


class Llama4Router(nn.Linear):
    """Linear router (HF name `router`, weight [E, D]): sigmoid of the top-k logits, 0 for the other experts."""

    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__(hidden, num_experts, bias=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [N, D]
        logits = super().forward(x)  # [N, E]
        top_logits, top_idx = torch.topk(logits, self.top_k, dim=-1)  # [N, K]
        acc = torch.promote_types(logits.dtype, torch.float32)  # HF: sigmoid in float32
        scores = torch.sigmoid(top_logits.to(acc)).to(logits.dtype)  # [N, K]
        return scores, top_idx


class Llama4MoE(nn.Module):
    """shared_expert(x) + sum over the chosen experts e of expert_e(x * score_e)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str = "silu") -> None:
        super().__init__()
        self.router = Llama4Router(hidden, num_experts, top_k)
        self.experts = Llama4Experts(num_experts, hidden, intermediate, act)
        self.shared_expert = GatedMLP(hidden, intermediate, act)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        fast = self.__dict__.get("accel")  # hybridcache.accel's fast path (a decode token's experts), once installed
        if fast is not None:
            out = fast(h)
            if out is not None:
                return out
        x = h.reshape(-1, h.shape[-1])  # [N, D]
        scores, top_idx = self.router(x)  # [N, K] each
        out = self.shared_expert(x)  # [N, D]
        routed = torch.zeros_like(out)
        if torch.compiler.is_compiling():  # static shapes: every expert on every token, kept where routed
            for e in range(self.experts.num_experts):
                chosen = top_idx == e  # [N, K]
                score = (scores * chosen).sum(-1, keepdim=True)  # [N, 1]
                routed = routed + torch.where(chosen.any(-1, keepdim=True), self.experts.expert(e, x * score), 0.0)
            return (out + routed).view_as(h)
        for e in torch.unique(top_idx).tolist():  # only experts that received tokens
            token, slot = torch.nonzero(top_idx == e, as_tuple=True)  # [M] each
            expert_in = x[token] * scores[token, slot, None]  # [M, D]: the score scales the input
            routed.index_add_(0, token, self.experts.expert(e, expert_in))
        return (out + routed).view_as(h)
