"""A decode step's whole decoder layer as one kernel call on CPU (kernels/cpu_decode.c, hc_decoder_layer): the
one-call attention (native/steps/attention.py: input norm, q / k / v, q / k norms, rotary, the token's keys and values
into the cache's reserved slot, attention) followed by the decoder tail (cpu_fused.py: o_proj, the residual add
between its norms, the gated MLP, its residual add). The same kernels in the same order as those two calls, so the
same numbers, with one call less of interpreter between them per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridcache.accel.native.checks import INT_MAX
from hybridcache.accel.native.fused import bind_decoder_tail
from hybridcache.accel.native.library import _library
from hybridcache.accel.native.steps.attention import bind_attention_step

_F32 = torch.float32


def _out(y: torch.Tensor, b: int, dm: int) -> bool:
    """y is a contiguous float32 CPU [b, 1, dm] the kernel may write."""
    return y.dtype is _F32 and y.is_cpu and y.shape == (b, 1, dm) and y.is_contiguous() and not y.requires_grad


def bind_decoder_layer(step: Callable | None, tail: Callable | None) -> Callable | None:
    """The two bound calls of one layer (bind_attention_step's and bind_decoder_tail's) as one: a function of the
    attention step's arguments (x [B, 1, Dm] being the layer's input, its residual too) -> the layer's output
    [B, 1, Dm], having written the token's keys and values into the reserved slot; None where the step's call
    would decline (nothing written). None here: the two do not fit together (the tail's width is not the
    attention's output, or its model width not the input's)."""
    lib = _library()
    if lib is None or step is None or tail is None:
        return None
    (dm, attn_width), (d, width, per_row) = step.dims, tail.dims
    if d != dm or width != attn_width:
        return None
    layer_fn = getattr(tail, "layer_fn", "hc_decoder_layer")
    if getattr(step, "gated", False):  # (a gated attention: only its whole layer with a gated MLP has a record)
        if layer_fn != "hc_decoder_layer":
            return None
        layer_fn = "hc_gated_decoder_layer"
    fn, prepare, static = getattr(lib, layer_fn), step.prepare, tail.static

    def record(x, y, cos, sin, keys, values, slot, q_pos, k_pos, pattern, param):
        """(hc_decoder_layer's arguments writing the layer's output into y [B, 1, Dm], the tensors they point
        into: keep them alive until the call), or None when the kernel does not take these (nothing written)."""
        x_storage = x.untyped_storage().data_ptr()  # (y must not share it: the kernel reads x after writing y)
        prepared = prepare(x, cos, sin, keys, values, slot, q_pos, k_pos, pattern, param)
        if prepared is None:
            return None
        args, a, alive = prepared
        b = x.shape[0]
        if b * per_row > INT_MAX or not _out(y, b, dm) or y.untyped_storage().data_ptr() == x_storage:
            return None
        scratch = torch.empty(b * per_row, dtype=_F32)
        return (*args, a.data_ptr(), *static, scratch.data_ptr(), y.data_ptr()), (alive, a, scratch, y)

    def run(x, cos, sin, keys, values, slot, q_pos, k_pos, pattern, param):
        y = torch.empty(x.shape[0], 1, dm, dtype=_F32)
        recorded = record(x, y, cos, sin, keys, values, slot, q_pos, k_pos, pattern, param)
        if recorded is None:
            return None
        if fn(*recorded[0]):
            raise MemoryError(f"hc_decoder_layer: no memory for the attention's scratch ({keys.shape[2]} slots)")
        return y

    run.record = record  # for a step that runs many layers in one call (cpu_decoder_stack.py)
    run.holds = (step, tail)  # alive while `run` is: C reads their tensors through raw pointers
    return run


def decoder_layer(x: torch.Tensor, step_args: tuple, tail_args: tuple, cache_args: tuple) -> torch.Tensor | None:
    """A whole decoder layer, flat: `step_args` = bind_attention_step's arguments after x's width (qkv, heads,
    kv_heads, head_dim, q_norm, k_norm, interleaved, in_norm, scale, softcap, sinks), `tail_args` =
    bind_decoder_tail's after its widths (o, post_attn, pre_mlp, gate_up, down, act, post_mlp), `cache_args` = the
    step's per-call arguments after x (cos, sin, keys, values, slot, q_pos, k_pos, pattern, param)."""
    if x.dim() != 3:
        return None
    qkv, heads, kv_heads, head_dim, *rest = step_args
    step = bind_attention_step(qkv, heads, kv_heads, head_dim, x.shape[2], *rest)
    tail = bind_decoder_tail(x.shape[2], heads * head_dim, *tail_args) if step is not None else None
    run = bind_decoder_layer(step, tail)
    return None if run is None else run(x, *cache_args)
