"""A decoder layer after its attention as one kernel call on CPU: the output projection, the residual add between
its norms, the gated MLP and its residual add (kernels/cpu_decode.c, hc_decoder_tail). The same kernels in the same
order as the separate calls (DecodeLinear, residual_norm, GatedMLP), so the same numbers; what goes is the
interpreter between them, which runs cold after every weight read."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.blocks.linear import DecodeLinear
from hybridcache.blocks.linear_group import _param
from hybridcache.blocks.mlp import GatedMLP
from hybridcache.blocks.norms import kernel_args, kernel_plain
from hybridcache.ops.kernel_calls import call, takes
from hybridcache.ops.op_specs import ACT_MUL

_F32 = torch.float32


def decoder_tail(
    h: torch.Tensor,
    a: torch.Tensor,
    o_proj: nn.Module,
    post_attn: nn.Module | None,
    pre_mlp: nn.Module | None,
    mlp: nn.Module,
    post_mlp: nn.Module | None,
) -> torch.Tensor | None:
    """h1 + post_mlp(mlp(pre_mlp(h1))) with h1 = h + post_attn(o_proj(a)) (a norm None: none), by one kernel call:
    h [..., D] the residual stream, a [..., A] the attention's output before o_proj. None (the caller's separate
    calls) unless this is a float32 CPU decode step the kernel takes: DecodeLinear projections, a GatedMLP whose
    activation the kernel computes, plain float32 RMSNorms."""
    if not (
        takes(a)
        and h.dtype is _F32
        and type(mlp) is GatedMLP
        and type(o_proj) is DecodeLinear
        and mlp.act_name in ACT_MUL
        and kernel_plain(post_attn)
        and kernel_plain(pre_mlp)
        and kernel_plain(post_mlp)
    ):
        return None
    down = mlp._modules["down_proj"]
    parts = mlp.gate_up.parts() if type(down) is DecodeLinear else None
    if parts is None:
        return None
    return call(
        "decoder_tail",
        h,
        a,
        _param(o_proj, "weight"),
        _param(o_proj, "bias"),
        o_proj._buffers.get("scale"),
        *kernel_args(post_attn),
        *kernel_args(pre_mlp),
        *parts,
        _param(down, "weight"),
        _param(down, "bias"),
        down._buffers.get("scale"),
        mlp.act_name,
        *kernel_args(post_mlp),
    )
