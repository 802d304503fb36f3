"""The fast path of the sparse MoE block (nn/moe/topk.py `SparseMoE` and the subclasses that route through its
forward, e.g. SharedExpertMoE; `moe.accel`, installed by accel.install).

A decode step of few tokens runs the reference's dense form (every expert on every token, weighted by the scattered
top-k weights, zero where not routed) over only the experts some token was routed to, in the same order: an expert
no token chose adds exact zeros there, so the result is the same bits and the step reads the routed experts'
weights only. One token where the reference takes its routed form (k < E) runs that form's arithmetic without its
per-expert search (the same bits too). (One difference: an unrouted expert whose output is not finite no longer
turns the sum into NaN.) A prefill, torch.compile (static shapes) and everything else run the reference.
"""

from __future__ import annotations

import torch

from hybridcache.nn.moe.topk import SparseMoE


class SparseMoEAccel:
    """`SparseMoE.accel`: accel(h [B, T, D]) -> the routed experts' sum [B, T, D], or None (the reference runs)."""

    def __init__(self, moe: SparseMoE) -> None:
        self.moe = moe

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:
        m = self.moe
        x = h.reshape(-1, h.shape[-1])  # [N, D]
        experts, rows = len(m.experts), x.shape[0]
        dense = rows * m.top_k >= experts and rows <= 16  # the reference's own condition for its dense form
        if torch.compiler.is_compiling() or not (dense or rows == 1):
            return None
        weights, index = m.route(x)  # [N, k] each
        out = torch.zeros_like(x)
        if not dense:  # one token: the reference's routed form, out[0] += expert(x) * weight, experts ascending
            for slot in torch.argsort(index[0]).tolist():
                out = out + m.experts[int(index[0, slot])](x) * weights[:, slot, None]
            return out.view_as(h)
        scattered = torch.zeros(rows, experts, dtype=weights.dtype, device=x.device)
        scattered.scatter_(1, index, weights)  # [N, E]
        for e in torch.unique(index).tolist():  # sorted: the reference's order
            out = out + m.experts[e](x) * scattered[:, e, None]
        return out.view_as(h)
