"""Sparse mixture of gated-MLP experts with a linear top-k router (Jamba / Mixtral style)."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.nn.core.mlp import GatedMLP


class SparseMoE(nn.Module):
    """`router` (linear, no bias) and `experts.E.{gate,up,down}_proj` (HF Jamba names).

    Routing: softmax of the router logits in float32, top-k experts per token, the k weights left as they
    are (Jamba) or renormalised to sum to 1 (`normalize=True`, Mixtral), then cast to the hidden dtype.
    """

    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str = "silu", normalize: bool = False
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k, self.normalize = top_k, normalize
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, act) for _ in range(num_experts))
        self.accel = None  # hybridcache.accel's fast path for this block, once installed

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k weights [N, k] (x.dtype) and expert indices [N, k] for tokens x [N, D]."""
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)  # [N, E]
        weights, index = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), index

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, T, D]
        fast = self.__dict__.get("accel")  # (a subclass may not run this __init__: DeepseekMoE)
        if fast is not None:
            out = fast(h)  # the fast path (only the routed experts of a decode step), where it takes this call
            if out is not None:
                return out
        x = h.reshape(-1, h.shape[-1])  # [N, D]
        weights, index = self.route(x)
        out = torch.zeros_like(x)
        # every expert on every token, zero weight where not routed: static shapes for torch.compile, and for a few
        # tokens that reach most experts anyway (a decode step) no gather / scatter / sync per expert
        if torch.compiler.is_compiling() or x.shape[0] * self.top_k >= len(self.experts) and x.shape[0] <= 16:
            dense = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype, device=x.device)
            dense.scatter_(1, index, weights)  # [N, E]
            for e, expert in enumerate(self.experts):
                out = out + expert(x) * dense[:, e, None]
            return out.view_as(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)  # tokens routed to expert e, and which of their k slots
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.view_as(h)
