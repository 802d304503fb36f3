"""Gemma 4's routed experts (the MoE branch that runs beside the dense MLP when `enable_moe_block`).

The router normalises its input (weightless RMS norm, times a learned `scale` and 1/sqrt(hidden)), softmaxes the
projected logits in float32, keeps the top k, renormalises them to sum to 1 and multiplies each by its expert's
learned `per_expert_scale`. Experts are fused as HF stores them: gate_up_proj [E, 2I, D] (gate | up, applied as
x @ W.T), down_proj [E, D, I].
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.nn.core.mlp import activation
from hybridcache.nn.core.norms import RMSNorm, WeightlessRMSNorm


class Gemma4Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k, self.root = top_k, hidden**-0.5
        self.norm = WeightlessRMSNorm(eps)
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k weights [N, k] (float32) and expert indices [N, k] for tokens x [N, D]."""
        probs = torch.softmax(self.proj(self.norm(x) * self.scale * self.root), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        return weights / weights.sum(-1, keepdim=True) * self.per_expert_scale[index], index


class Gemma4Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))
        self.act = activation(act)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # x [N, D] -> [N, D]
        gate, up = nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)  # [N, I] each
        return nn.functional.linear(self.act(gate) * up, self.down_proj[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # x [N, D]
        fast = self.__dict__.get("accel")  # hybridcache.accel's fast path (a decode token's experts), once installed
        if fast is not None:
            out = fast(x, weights, index)
            if out is not None:
                return out
        out = torch.zeros_like(x)
        if torch.compiler.is_compiling():  # static shapes: every expert on every token, weight 0 where not routed
            for e in range(self.num_experts):
                w = (weights * (index == e)).sum(-1, keepdim=True)  # [N, 1]
                out = out + (self.expert(e, x) * w).to(x.dtype)
            return out
        for e in torch.unique(index).tolist():  # only the experts that received tokens
            token, slot = torch.nonzero(index == e, as_tuple=True)  # [M] each
            out.index_add_(0, token, (self.expert(e, x[token]) * weights[token, slot, None]).to(x.dtype))
        return out


class Gemma4MoEBranch(nn.Module):
    """The experts beside the dense MLP (HF: a layer's `router`, `experts`, `pre_feedforward_layernorm_2`,
    `post_feedforward_layernorm_1` / `_2`): norm_1(mlp output) + norm_2(experts(pre_norm_2(h))), routed on the
    residual stream h."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, act: str, eps: float) -> None:
        super().__init__()
        self.router = Gemma4Router(hidden, num_experts, top_k, eps)
        self.experts = Gemma4Experts(num_experts, hidden, intermediate, act)
        for name in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
            setattr(self, name, RMSNorm(hidden, eps, scale_in_float32=True))

    def forward(self, mlp_out: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # [B, T, D] each
        flat = h.reshape(-1, h.shape[-1])  # [N, D]
        routed = self.experts(self.pre_feedforward_layernorm_2(flat), *self.router(flat)).view_as(h)
        return self.post_feedforward_layernorm_1(mlp_out) + self.post_feedforward_layernorm_2(routed)
