"""A decoder layer after its attention as one kernel call on CPU: the output projection, the residual add between
its norms, the gated MLP and its residual add (kernels/cpu_decode.c, hc_decoder_tail). The same kernels in the same
order as the separate calls (DecodeLinear, residual_norm, GatedMLP), so the same numbers; what goes is the
interpreter between them, which runs cold after every weight read."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.accel.kernel_memo import KernelMemo, norm_key, tensor_key
from hybridcache.accel.native.checks import _ptr
from hybridcache.accel.native.fused import _matrix, _norm_args, _norm_ok, _vector, bind_decoder_tail
from hybridcache.accel.native.kernel_calls import call, takes
from hybridcache.accel.native.op_declarations import ACT_MUL
from hybridcache.nn.core.linear import DecodeLinear
from hybridcache.nn.core.linear_group import _param
from hybridcache.nn.core.mlp import GatedMLP
from hybridcache.nn.core.norms import kernel_args, kernel_plain

_F32 = torch.float32


def decoder_tail(
    h: torch.Tensor,
    a: torch.Tensor,
    o_proj: nn.Module,
    post_attn: nn.Module | None,
    pre_mlp: nn.Module | None,
    mlp: nn.Module,
    post_mlp: nn.Module | None,
    memo: KernelMemo | None = None,
) -> torch.Tensor | None:
    """h1 + post_mlp(mlp(pre_mlp(h1))) with h1 = h + post_attn(o_proj(a)) (a norm None: none), by one kernel call:
    h [..., D] the residual stream, a [..., A] the attention's output before o_proj. None (the caller's separate
    calls) unless this is a float32 CPU decode step the kernel takes: DecodeLinear projections, a GatedMLP whose
    activation the kernel computes, plain float32 RMSNorms. With `memo` (the layer's), eager calls are bound once
    to these modules' weights and norms (kernel_memo.py)."""
    if not (takes(a) and h.dtype is _F32):
        return None
    if memo is None or torch.compiler.is_compiling():
        return _call(h, a, o_proj, post_attn, pre_mlp, mlp, post_mlp)
    run = bound_tail(h.shape[-1], a.shape[-1], o_proj, post_attn, pre_mlp, mlp, post_mlp, memo)
    return None if run is None else run(h, a)


def bound_tail(
    d: int,
    width: int,
    o_proj: nn.Module,
    post_attn: nn.Module | None,
    pre_mlp: nn.Module | None,
    mlp: nn.Module,
    post_mlp: nn.Module | None,
    memo: KernelMemo,
):
    """decoder_tail's call bound to these modules (fused.py bind_decoder_tail) for a residual of width d
    and an attention output of `width`, kept in `memo`; None: the kernel does not take them. A decoder layer that
    runs its whole decode step in one call (decoder_layer.py) ends with it."""
    down = mlp._modules.get("down_proj") if _gated(mlp) else None
    f = mlp.gate_up._fused if down is not None else None
    key = (
        d,
        width,
        id(o_proj),
        type(o_proj),
        *(tensor_key(t) for t in _linear(o_proj)),
        id(mlp),
        type(mlp),
        None if f is None else (id(f[0]), id(f[1]), id(f[2]), f[3] == mlp.gate_up._pointers()),  # held by the call
        type(down),
        *(tensor_key(t) for t in _linear(down)),
        getattr(mlp, "act_name", None),
        norm_key(post_attn),
        norm_key(pre_mlp),
        norm_key(post_mlp),
    )
    return memo.get(key, lambda: _bind(d, width, o_proj, post_attn, pre_mlp, mlp, post_mlp))


def _gated(mlp: nn.Module) -> bool:
    """Whether `mlp` computes GatedMLP's forward (a subclass with its own forward says not: computes_gated_mlp)."""
    return isinstance(mlp, GatedMLP) and mlp.computes_gated_mlp


def _linear(lin: nn.Module | None) -> tuple[torch.Tensor | None, ...]:
    """A projection's weight, bias and per-row scale (int8), as the kernels take them."""
    if lin is None:
        return None, None, None
    return _param(lin, "weight"), _param(lin, "bias"), lin._buffers.get("scale")


def _takes(o_proj, post_attn, pre_mlp, mlp, post_mlp) -> tuple | None:
    """(gate / up parts, down projection) when the kernel computes these modules, else None."""
    if not (
        _gated(mlp)
        and type(o_proj) is DecodeLinear
        and mlp.act_name in ACT_MUL
        and kernel_plain(post_attn)
        and kernel_plain(pre_mlp)
        and kernel_plain(post_mlp)
    ):
        return None
    down = mlp._modules["down_proj"]
    parts = mlp.gate_up.parts() if type(down) is DecodeLinear else None
    return None if parts is None else (parts, down)


def _bind(d, width, o_proj, post_attn, pre_mlp, mlp, post_mlp):
    taken = _takes(o_proj, post_attn, pre_mlp, mlp, post_mlp)
    if taken is None:
        return None
    parts, down = taken
    return bind_decoder_tail(
        d,
        width,
        _linear(o_proj),
        *(None if n is None else kernel_args(n) for n in (post_attn, pre_mlp)),
        parts,
        _linear(down),
        mlp.act_name,
        None if post_mlp is None else kernel_args(post_mlp),
    )


def _call(h, a, o_proj, post_attn, pre_mlp, mlp, post_mlp) -> torch.Tensor | None:
    """The op on its flat arguments (what torch.compile traces)."""
    taken = _takes(o_proj, post_attn, pre_mlp, mlp, post_mlp)
    if taken is None:
        return None
    parts, down = taken
    return call(
        "decoder_tail",
        h,
        a,
        *_linear(o_proj),
        *kernel_args(post_attn),
        *kernel_args(pre_mlp),
        *parts,
        *_linear(down),
        mlp.act_name,
        *kernel_args(post_mlp),
    )


def bound_attention_tail(d: int, width: int, o_proj: nn.Module, post_attn: nn.Module | None, memo: KernelMemo):
    """The tail of an attention layer with no MLP (Nemotron-H's attention blocks: h + o_proj(a), post_attn: h +
    post_attn(o_proj(a))) as hc_attention_layer's part of the layer record (csrc/fused_layer.c: hc_decoder_layer's
    layout, the MLP fields NULL / 0), kept in `memo`; None: the kernel does not take them. Only a record's (no
    direct call): `static`, `dims` and `layer_fn` as decoder_layer.bind_decoder_layer reads a bound tail's."""
    key = ("attention_tail", d, width, id(o_proj), type(o_proj), *(tensor_key(t) for t in _linear(o_proj)))
    return memo.get((*key, norm_key(post_attn)), lambda: _bind_attention_tail(d, width, o_proj, post_attn))


class _AttentionTail:
    layer_fn = "hc_attention_layer"

    def __init__(self, o: tuple, post_attn, static: tuple, dims: tuple) -> None:
        self.holds, self.static, self.dims = (o, post_attn), static, dims  # (holds: C reads these tensors)


def _bind_attention_tail(d, width, o_proj, post_attn):
    if type(o_proj) is not DecodeLinear or not kernel_plain(post_attn) or not all(type(v) is int for v in (d, width)):
        return None
    o, post = _linear(o_proj), None if post_attn is None else kernel_args(post_attn)
    (w_o, b_o, s_o), t_o = o, _matrix(o[0], d, width, o[2]) if d >= 1 and width >= 1 else None
    if t_o is None or not _vector(b_o, d) or not _norm_ok(post, d):
        return None
    none_mlp = (None, 0.0, 0, None, 0, None, None, None, 0, None, None, 0, None, 0.0)  # pre_mlp .. post_mlp_eps
    static = (w_o.data_ptr(), t_o, _ptr(s_o), _ptr(b_o), *_norm_args(post), *none_mlp)
    return _AttentionTail(o, post, static, (d, width, d))  # (per row: o [Dm] in the tail scratch)
