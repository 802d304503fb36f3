"""A decode step's attention as one kernel call on CPU (kernels/cpu_decode.c, hc_attention_step): the layer's input
norm, the fused q / k / v projection, q / k norms and rotary (as hc_qkv_norm_rope), the token's keys and values
written straight into the slot its cache reserved, and the attention over every slot (as hc_decode_attention).

The same kernels in the same order as the separate calls, so the same numbers. What goes is the interpreter between
them: the q / k / v tensors handed back to Python, the copy of k and v into the cache, and the attention call's
wrapper, each running cold after a weight read (nn/attention/mixer.py's `_one_call_step`; a cache layer offers the
slot
through AttentionCacheLayer.decode_slot).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridcache.accel.native.attention import _pattern, _rotary_ok
from hybridcache.accel.native.checks import INT_MAX, MAX_ROWS, _cpu, _dense_last, _eager, _ptr, _real
from hybridcache.accel.native.checks import _vec as _vector
from hybridcache.accel.native.fused import qkv_static
from hybridcache.accel.native.library import _library

_F32, _I64 = torch.float32, torch.int64


def bind_attention_step(
    qkv: tuple,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dm: int,
    q_norm: tuple | None,
    k_norm: tuple | None,
    interleaved: bool,
    in_norm: tuple | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    gated: bool = False,
) -> Callable | None:
    """attention_step with everything but the step's tensors checked once: a function of (x [B, 1, dm], cos, sin,
    keys, values [B, kv_heads, S, head_dim], slot, q_pos [B, 1], k_pos [B, S], pattern, param) -> the attention's
    output [B, 1, heads * head_dim] before the output projection, having written the token's keys and values into
    `slot`; or None (nothing written) for a call its kernel does not take. None here: these weights / norms never
    are (as bind_qkv_norm_rope). `gated`: q_proj yields per head [query | gate], the output times sigmoid(gate)
    (hc_gated_attention_step)."""
    lib, static = _library(), qkv_static(qkv, heads, kv_heads, head_dim, dm, q_norm, k_norm, in_norm, gated)
    if (
        lib is None
        or static is None
        or heads % kv_heads
        or not _real(scale)
        or not (softcap is None or _real(softcap) and softcap > 0)
        or not _vector(sinks, heads)
    ):
        return None
    fn = lib.hc_gated_attention_step if gated else lib.hc_attention_step
    d, kv, width = head_dim, kv_heads, ((2 if gated else 1) * heads + 2 * kv_heads) * head_dim
    weights, norms, last = static
    tail = (scale, softcap or 0.0, _ptr(sinks))
    per_row = dm + width + (heads + kv_heads) * d  # scratch floats: normed x, q / k / v, rotated q, rotated k

    def prepare(x, cos, sin, keys, values, slot, q_pos, k_pos, pattern, param):
        """(hc_attention_step's arguments up to its output, the output [B, 1, Hq * D] to pass, the tensors those
        arguments point into: keep them alive until the call), or None when the kernel does not take these."""
        if not _eager(x) or x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != dm:
            return None
        b = x.shape[0]
        s = keys.shape[2] if keys.dim() == 4 else 0
        if (
            not 0 < b <= MAX_ROWS
            or b * per_row > INT_MAX  # (every size C computes from them stays a C int, as qkv_norm_rope's)
            or not _rotary_ok(cos, sin, b, 1, d)
            or not (_cpu(keys) and _cpu(values) and keys.shape == (b, kv, s, d) and values.shape == keys.shape)
            or not (_dense_last(keys) and _dense_last(values) and keys.numel() <= INT_MAX)
            or type(slot) is not int
            or not 0 <= slot < s
            or not (_cpu(q_pos, _I64) and _cpu(k_pos, _I64) and q_pos.numel() == b and k_pos.shape == (b, s))
        ):
            return None
        code, value = _pattern(pattern, param)
        x, q_pos, k_pos = x.contiguous(), q_pos.reshape(b).contiguous(), k_pos.contiguous()
        scratch = torch.empty(b * per_row, dtype=_F32)
        xn, qkv_out = scratch.data_ptr(), scratch.data_ptr() + 4 * b * dm
        q_out, k_new = qkv_out + 4 * b * width, qkv_out + 4 * b * (width + heads * d)  # (q: ungated, contiguous)
        r = 0 if cos is None else cos.shape[-1]
        args = (
            *(x.data_ptr(), b, *weights, qkv_out, *norms, _ptr(cos), _ptr(sin), r, int(interleaved), q_out, k_new),
            *(*last, xn, keys.data_ptr(), values.data_ptr(), slot, s, *keys.stride()[:3], *values.stride()[:3]),
            *(q_pos.data_ptr(), k_pos.data_ptr(), code, value, *tail),
        )
        return args, torch.empty(b, 1, heads * d, dtype=_F32), (x, q_pos, k_pos, scratch, cos, sin, keys, values)

    def run(x, cos, sin, keys, values, slot, q_pos, k_pos, pattern, param):
        prepared = prepare(x, cos, sin, keys, values, slot, q_pos, k_pos, pattern, param)
        if prepared is None:
            return None
        args, out, _alive = prepared
        if fn(*args, out.data_ptr()):
            raise MemoryError(f"hc_attention_step: no memory for the attention's scratch ({keys.shape[2]} slots)")
        return out

    run.holds = (qkv, q_norm, k_norm, in_norm, sinks)  # alive while `run` is: C reads them through raw pointers
    # for a call that goes on (decoder_layer.py: the gated step's whole layer is hc_gated_decoder_layer)
    run.prepare, run.dims, run.gated = prepare, (dm, heads * head_dim), gated
    return run


def attention_step(
    x: torch.Tensor,
    qkv: tuple,
    heads: int,
    kv_heads: int,
    head_dim: int,
    q_norm: tuple | None,
    k_norm: tuple | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    interleaved: bool,
    in_norm: tuple | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    pattern: str,
    param: int,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A decode step's attention, x [B, 1, Dm] -> [B, 1, Hq * D] (see bind_attention_step; arguments as
    qkv_norm_rope's and decode_attention's), writing the token's keys and values into `slot` of keys / values."""
    if not _eager(x) or x.dim() != 3:
        return None
    run = bind_attention_step(
        qkv, heads, kv_heads, head_dim, x.shape[2], q_norm, k_norm, interleaved, in_norm, scale, softcap, sinks
    )
    return None if run is None else run(x, cos, sin, keys, values, slot, q_pos, k_pos, pattern, param)
