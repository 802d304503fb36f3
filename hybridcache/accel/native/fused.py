"""A decoder layer's branches as one kernel call each on CPU (kernels/cpu_decode.c): the gated MLP (gate / up
projection, activation x product, down projection) and the attention input (q / k / v projection, q / k norms and
rotary). The same kernels in the same order as the separate calls, so the same numbers; what goes is the
interpreter between them, which runs cold after every weight read (the read evicts its working set from the CPU
caches) and cost a quarter of a Gemma 3 270M bfloat16 decode step. Every function returns None (the caller's
separate calls) for anything it does not take.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridcache.accel.native.attention import _rotary_ok
from hybridcache.accel.native.checks import INT_MAX, MAX_ROWS, _eager, _ptr, _q8_scale, _real
from hybridcache.accel.native.checks import _vec as _vector
from hybridcache.accel.native.library import _library
from hybridcache.accel.native.op_declarations import ACT_MUL, Q8_0_TYPE, WEIGHT_TYPES

_F32 = torch.float32


def _matrix(w: torch.Tensor, rows: int, cols: int, scale: torch.Tensor | None = None) -> int | None:
    """The kernel's type code of a [rows, cols] contiguous strided CPU weight (each size a C int) with its `scale`
    (None; a float32 vector [rows] for int8; a float16 [rows, cols / 32] for q8_0), or None."""
    code = WEIGHT_TYPES.get(w.dtype)
    if code == WEIGHT_TYPES[torch.int8] and scale is not None and scale.dim() == 2:
        code = Q8_0_TYPE if _q8_scale(scale, rows, cols) else None
    elif not _vector(scale, rows):
        return None
    if (
        code is None
        or w.shape != (rows, cols)
        or not w.is_cpu
        or w.layout != torch.strided
        or not w.is_contiguous()
        or rows > INT_MAX
        or cols > INT_MAX
    ):
        return None
    return code


def gated_mlp(x: torch.Tensor, gate_up: tuple, down: tuple, act: str) -> torch.Tensor | None:
    """down(act(gate(x)) * up(x)) for x [..., D] of at most MAX_ROWS rows; `gate_up` = (weight [2I, D], bias, scale)
    with the gate rows first, `down` = (weight [D, I], bias, scale)."""
    code = ACT_MUL.get(act) if isinstance(act, str) else None
    if code is None or not _eager(x) or x.dim() == 0:
        return None
    lib = _library()
    (w_gu, b_gu, s_gu), (w_dn, b_dn, s_dn) = gate_up, down
    d = x.shape[-1]
    two_i = w_gu.shape[0] if w_gu.dim() == 2 else -1
    rows = x.numel() // d if d else 0
    i = two_i // 2
    t_gu, t_dn = _matrix(w_gu, two_i, d, s_gu), _matrix(w_dn, d, i, s_dn)
    if (
        lib is None
        or t_gu is None
        or t_dn is None
        or two_i % 2
        or not 0 < rows <= MAX_ROWS
        or rows * 3 * i > INT_MAX
        or not _vector(b_gu, two_i)
        or not _vector(b_dn, d)
    ):
        return None
    x = x.contiguous()
    scratch = torch.empty(rows * 3 * i, dtype=torch.float32)
    y = torch.empty(x.shape, dtype=torch.float32)
    lib.hc_gated_mlp(
        x.data_ptr(), rows, d, i, *_mlp_args(gate_up, t_gu, down, t_dn, code), scratch.data_ptr(), y.data_ptr()
    )
    return y


def _mlp_args(gate_up: tuple, t_gu: int, down: tuple, t_dn: int, code: int) -> tuple:
    """hc_gated_mlp's weight arguments (also hc_decoder_tail's): each matrix, its type code, scale, bias; the act."""
    (w_gu, b_gu, s_gu), (w_dn, b_dn, s_dn) = gate_up, down
    return w_gu.data_ptr(), t_gu, _ptr(s_gu), _ptr(b_gu), w_dn.data_ptr(), t_dn, _ptr(s_dn), _ptr(b_dn), code


def qkv_norm_rope(
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
    in_norm: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q [B, Hq, T, D], k and v [B, Hkv, T, D] from x [B, T, Dm] (B * T at most MAX_ROWS): the layer's input RMSNorm
    (`in_norm` = (scale [Dm], eps), None: none), the fused projection `qkv` = (weight [(Hq + 2 Hkv) D, Dm], bias,
    scale), then each of q and k through its RMSNorm (`q_norm` / `k_norm` = (scale [D], eps), None: none) and
    rotary by cos / sin [B, 1, T, R] (None: none); v is a view."""
    if not _eager(x) or x.dim() != 3:
        return None
    run = bind_qkv_norm_rope(qkv, heads, kv_heads, head_dim, x.shape[2], q_norm, k_norm, interleaved, in_norm)
    return None if run is None else run(x, cos, sin)


def qkv_static(
    qkv: tuple, heads: int, kv_heads: int, head_dim: int, dm: int, q_norm, k_norm, in_norm, gated: bool = False
) -> tuple[tuple, tuple, tuple] | None:
    """The q / k / v kernels' checked static C arguments (hc_qkv_norm_rope's, and hc_attention_step's which start
    the same way): (the projection's from dm on, the q / k norms', the input norm's), or None for weights, norms or
    sizes they do not take. `gated`: the projection yields per q head [query | gate] (hc_gated_attention_step)."""
    w, bias, wscale = qkv
    if not all(type(v) is int and v >= 1 for v in (heads, kv_heads, head_dim, dm)):
        return None
    width = ((2 if gated else 1) * heads + 2 * kv_heads) * head_dim
    code = _matrix(w, width, dm, wscale)
    if (
        code is None
        or not _vector(bias, width)
        or not (_norm_ok(q_norm, head_dim) and _norm_ok(k_norm, head_dim) and _norm_ok(in_norm, dm))
    ):
        return None
    weights = (dm, w.data_ptr(), code, _ptr(wscale), _ptr(bias), heads, kv_heads, head_dim)
    return weights, (*_norm_args(q_norm), *_norm_args(k_norm)), _norm_args(in_norm)


def bind_qkv_norm_rope(
    qkv: tuple,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dm: int,
    q_norm: tuple | None,
    k_norm: tuple | None,
    interleaved: bool,
    in_norm: tuple | None = None,
) -> Callable | None:
    """qkv_norm_rope with everything but x and the rotary tables checked once: a function of (x [B, T, dm], cos,
    sin) -> (q, k, v), or None for a call its kernel does not take (then this returns None: the same arguments
    would never be taken). The function holds the tensors it points C at; a block keeps it while they stay its own
    (accel/kernel_memo.py)."""
    lib, static = _library(), qkv_static(qkv, heads, kv_heads, head_dim, dm, q_norm, k_norm, in_norm)
    if lib is None or static is None:
        return None
    fn, kv_at, d, width = (
        lib.hc_qkv_norm_rope,
        (heads + kv_heads) * head_dim,
        head_dim,
        (heads + 2 * kv_heads) * head_dim,
    )
    weights, norms, last = static

    def run(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        if not _eager(x) or x.dim() != 3 or x.shape[2] != dm:
            return None
        b, t = x.shape[0], x.shape[1]
        if not 0 < b * t <= MAX_ROWS or b * t * width > INT_MAX or not _rotary_ok(cos, sin, b, t, d):
            return None
        x = x.contiguous()
        xn = None if in_norm is None else torch.empty(b * t * dm, dtype=_F32)
        out = torch.empty(b, t, width, dtype=_F32)
        q = torch.empty(b, heads, t, d, dtype=_F32)
        k = torch.empty(b, kv_heads, t, d, dtype=_F32)
        r = 0 if cos is None else cos.shape[-1]
        fn(
            x.data_ptr(),
            b,
            t,
            *weights,
            out.data_ptr(),
            *norms,
            _ptr(cos),
            _ptr(sin),
            r,
            int(interleaved),
            q.data_ptr(),
            k.data_ptr(),
            *last,
            None if xn is None else xn.data_ptr(),
        )
        return q, k, out.narrow(2, kv_at, kv_heads * d).view(b, t, kv_heads, d).transpose(1, 2)

    run.holds = (qkv, q_norm, k_norm, in_norm)  # alive while `run` is: C reads them through raw pointers
    return run


def _norm_ok(norm: tuple | None, d: int) -> bool:
    return norm is None or (norm[0] is not None and _vector(norm[0], d) and _real(norm[1]))


def _norm_args(norm: tuple | None) -> tuple:
    """A norm's (scale pointer, eps) for C: (NULL, 0) for none."""
    return (None, 0.0) if norm is None else (norm[0].data_ptr(), norm[1])


def decoder_tail(
    h: torch.Tensor,
    a: torch.Tensor,
    o: tuple,
    post_attn: tuple | None,
    pre_mlp: tuple | None,
    gate_up: tuple,
    down: tuple,
    act: str,
    post_mlp: tuple | None,
) -> torch.Tensor | None:
    """A decoder layer after its attention, h [..., D] and the attention's output a [..., A] (before its output
    projection) of at most MAX_ROWS rows: h1 = h + o_proj(a) (rms-normed by `post_attn` unless None), then
    h1 + the gated MLP of rms_norm(h1) by `pre_mlp` (h1 itself if None), rms-normed by `post_mlp` unless None.
    `o` = (weight [D, A], bias, scale), `gate_up` / `down` as gated_mlp's, each norm (effective scale [D], eps)."""
    if not _eager(h) or not _eager(a) or h.dim() == 0 or a.dim() == 0:
        return None
    run = bind_decoder_tail(h.shape[-1], a.shape[-1], o, post_attn, pre_mlp, gate_up, down, act, post_mlp)
    return None if run is None else run(h, a)


def bind_decoder_tail(
    d: int,
    width: int,
    o: tuple,
    post_attn: tuple | None,
    pre_mlp: tuple | None,
    gate_up: tuple,
    down: tuple,
    act: str,
    post_mlp: tuple | None,
) -> Callable | None:
    """decoder_tail with everything but h [..., d] and a [..., width] checked once: a function of (h, a) -> the
    layer's output, or None for a call its kernel does not take (as bind_qkv_norm_rope)."""
    code = ACT_MUL.get(act) if isinstance(act, str) else None
    lib = _library()
    if code is None or lib is None or not all(type(v) is int and v >= 1 for v in (d, width)):
        return None
    (w_o, b_o, s_o), (w_gu, b_gu, s_gu), (w_dn, b_dn, s_dn) = o, gate_up, down
    two_i = w_gu.shape[0] if w_gu.dim() == 2 else -1
    i = two_i // 2
    t_o, t_gu, t_dn = _matrix(w_o, d, width, s_o), _matrix(w_gu, two_i, d, s_gu), _matrix(w_dn, d, i, s_dn)
    if (
        t_o is None
        or t_gu is None
        or t_dn is None
        or two_i % 2
        or not (_vector(b_o, d) and _vector(b_gu, two_i) and _vector(b_dn, d))
        or not (_norm_ok(post_attn, d) and _norm_ok(pre_mlp, d) and _norm_ok(post_mlp, d))
    ):
        return None
    fn, per_row = lib.hc_decoder_tail, 4 * d + 3 * i
    middle = (w_o.data_ptr(), t_o, _ptr(s_o), _ptr(b_o), *_norm_args(post_attn), *_norm_args(pre_mlp), i)
    last = (*_mlp_args(gate_up, t_gu, down, t_dn, code), *_norm_args(post_mlp))

    def run(h: torch.Tensor, a: torch.Tensor) -> torch.Tensor | None:
        if not _eager(h) or not _eager(a) or h.shape[:-1] != a.shape[:-1] or h.shape[-1] != d or a.shape[-1] != width:
            return None
        rows = h.numel() // d
        if not 0 < rows <= MAX_ROWS or rows * per_row > INT_MAX:
            return None
        h, a = h.contiguous(), a.contiguous()
        scratch = torch.empty(rows * per_row, dtype=_F32)
        y = torch.empty(h.shape, dtype=_F32)
        fn(h.data_ptr(), a.data_ptr(), rows, d, width, *middle, *last, scratch.data_ptr(), y.data_ptr())
        return y

    run.holds = (o, post_attn, pre_mlp, gate_up, down, post_mlp)  # alive while `run` is (as in bind_qkv_norm_rope)
    run.static, run.dims = (*middle, *last), (d, width, per_row)  # for a call that ends with it (cpu_decoder_layer.py)
    return run
