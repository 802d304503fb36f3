"""The fast path of the mixture-of-experts blocks (`moe.accel`, installed by accel.install): a decode step runs only
the experts its tokens were routed to, with none of the reference's per-expert search (unique / where / index_add).

- `SparseMoE` (nn/moe/topk.py) and the subclasses that route through its forward (e.g. SharedExpertMoE): a decode
  step of few tokens runs the reference's dense form (every expert on every token, weighted by the scattered top-k
  weights, zero where not routed) over only the experts some token was routed to, in the same order: an expert no
  token chose adds exact zeros there, so the result is the same bits and the step reads the routed experts' weights
  only. One token where the reference takes its routed form (k < E) runs that form's arithmetic without its
  per-expert search (the same bits too). (One difference: an unrouted expert whose output is not finite no longer
  turns the sum into NaN.)
- One token through the routed form of a block with `route(x)` and `expert(e, x)` (Granite's stacked experts,
  registered by its model file), of Nemotron-H's latent MoE (registered by its model file), of Llama4's MoE (the
  score scales the expert's input; the shared expert first) and of Gemma 4's experts (the router's weights given):
  the reference's index_add_ of each routed expert into zeros, experts ascending, is the same additions as
  out = out + expert(x) * weight in that order: the same bits.
- One eager float32 token of GPT-OSS's MoE (registered by its model file): the router in torch, the top-k fused
  experts in one C call (native/steps/moe.py): float32 noise, not the same bits (the reference gathers the k experts'
  weights and runs an einsum).
A prefill, torch.compile (static shapes) and everything else run the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.accel.native.steps.moe import oss_experts_step
from hybridcache.nn.moe.gemma4 import Gemma4Experts
from hybridcache.nn.moe.llama4 import Llama4MoE
from hybridcache.nn.moe.topk import SparseMoE


def _one_token(h: torch.Tensor) -> torch.Tensor | None:
    """h as x [1, D] where it is one eager token, else None."""
    if torch.compiler.is_compiling() or h.numel() != h.shape[-1]:
        return None
    return h.reshape(1, h.shape[-1])


def _ascending(index: torch.Tensor) -> list[tuple[int, int]]:
    """(expert, slot) of one token's routing index [1, k], experts ascending (the reference's torch.unique order)."""
    return sorted((e, slot) for slot, e in enumerate(index[0].tolist()))


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


class RoutedExpertsAccel:
    """The accel of a block with `route(x) -> (weights [N, k] in x.dtype, index [N, k])` and `expert(e, x)` whose
    reference sums the routed experts' weighted outputs into zeros of x (Granite's): one token -> [B, T, D]."""

    def __init__(self, moe: nn.Module) -> None:
        self.moe = moe

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:
        x = _one_token(h)
        if x is None:
            return None
        weights, index = self.moe.route(x)
        out = torch.zeros_like(x)
        for e, slot in _ascending(index):
            out = out + self.moe.expert(e, x) * weights[:, slot, None]
        return out.view_as(h)


class LatentExpertsAccel:
    """Nemotron-H's MoE (`gate`, `experts`, optional fc1 / fc2_latent_proj, `shared_experts`): one token, routed
    outputs weighted and summed in the router's dtype, then cast -> [B, T, D]."""

    def __init__(self, moe: nn.Module) -> None:
        self.moe = moe

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:
        m, x = self.moe, _one_token(h)
        if x is None:
            return None
        weights, index = m.gate(x)
        if m.fc1_latent_proj is not None:
            x = m.fc1_latent_proj(x)
        out = torch.zeros(*x.shape, dtype=weights.dtype, device=x.device)  # [1, D']
        for e, slot in _ascending(index):
            out = out + m.experts[e](x) * weights[:, slot, None]
        out = out.to(h.dtype)
        if m.fc2_latent_proj is not None:
            out = m.fc2_latent_proj(out)
        return out.view_as(h) + m.shared_experts(h)


class Llama4MoEAccel:
    """`Llama4MoE.accel`: one token, the shared expert plus each routed expert on its score-scaled input."""

    def __init__(self, moe: Llama4MoE) -> None:
        self.moe = moe

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:
        m, x = self.moe, _one_token(h)
        if x is None:
            return None
        scores, index = m.router(x)  # [1, K] each
        out = m.shared_expert(x)
        routed = torch.zeros_like(out)
        for e, slot in _ascending(index):
            routed = routed + m.experts.expert(e, x * scores[:, slot, None])
        return (out + routed).view_as(h)


class Gemma4ExpertsAccel:
    """`Gemma4Experts.accel`: accel(x [N, D], weights [N, k], index [N, k]) for one token: each routed expert's
    weighted output cast to x's dtype, added to zeros in ascending expert order (the reference's index_add_ order:
    the same bits) -> [1, D]; None (the reference runs) for more tokens."""

    def __init__(self, experts: Gemma4Experts) -> None:
        self.experts = experts

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor | None:
        if torch.compiler.is_compiling() or x.dim() != 2 or x.shape[0] != 1:
            return None
        out = torch.zeros_like(x)
        for e, slot in _ascending(index):
            out = out + (self.experts.expert(e, x) * weights[:, slot, None]).to(x.dtype)
        return out


class OssExpertsAccel:
    """GPT-OSS's MoE (`router`, `top_k`, fused `experts`; registered by its model file): one eager float32 token, the
    router in torch, its top-k experts in one C call (native/steps/moe.py; float32 noise from the reference's
    einsum over the gathered weights, the same tokens) -> [B, T, D]."""

    def __init__(self, moe: nn.Module) -> None:
        self.moe = moe

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:
        m, x = self.moe, _one_token(h)
        if x is None or x.dtype != torch.float32 or torch.is_grad_enabled():
            return None
        top, index = torch.topk(m.router(x), m.top_k, dim=-1)  # [1, k]
        ex = m.experts
        y = oss_experts_step(
            x, index, torch.softmax(top, dim=-1), ex.gate_up_proj, ex.gate_up_proj_bias, ex.down_proj,
            ex.down_proj_bias, ex.alpha, ex.limit,
        )  # fmt: skip
        return None if y is None else y.view_as(h)


def _exactly(cls: type[nn.Module], make):
    return lambda moe: make(moe) if type(moe) is cls else None


def routed_experts_accel(cls: type[nn.Module]):
    """The registry's maker for blocks of exactly `cls` with route / expert (RoutedExpertsAccel)."""
    return _exactly(cls, RoutedExpertsAccel)


def latent_experts_accel(cls: type[nn.Module]):
    """The registry's maker for Nemotron-H's MoE blocks of exactly `cls` (LatentExpertsAccel)."""
    return _exactly(cls, LatentExpertsAccel)


def oss_experts_accel(cls: type[nn.Module]):
    """The registry's maker for GPT-OSS's MoE blocks of exactly `cls` (OssExpertsAccel)."""
    return _exactly(cls, OssExpertsAccel)


llama4_moe_accel = _exactly(Llama4MoE, Llama4MoEAccel)
gemma4_experts_accel = _exactly(Gemma4Experts, Gemma4ExpertsAccel)
