"""The C kernels of a decode step's attention and scans (kernels/cpu_decode.c): one-query grouped attention that
evaluates its pattern (full / sliding / chunked, a table in op_declarations.PATTERNS) from positions, rotary, q / k norm
+ rotary, the Mamba1 selective scan. Each returns None (the caller's torch path) for anything its kernel does not
take; KernelArgumentError for what no implementation takes. See kernels.py.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from hybridcache.accel.native.checks import INT_MAX, KernelArgumentError, _cpu, _dense_last, _eager, _real, _vec
from hybridcache.accel.native.library import _library
from hybridcache.accel.native.op_declarations import PATTERNS

_MAX_PARAM = 1 << 62  # a window / chunk beyond this cannot differ from full attention on int64 positions


def _pattern(name, param) -> tuple[int, int]:
    """(code, parameter) of a positional pattern; KernelArgumentError for one no implementation takes."""
    if name not in PATTERNS:
        raise KernelArgumentError(f"unknown attention pattern {name!r}; known: {', '.join(PATTERNS)}")
    if name == "full":
        return 0, 0
    what = "window" if name == "sliding" else "chunk size"
    try:
        value = operator.index(param)  # any integer type (numpy's too), not a float or a bool
    except TypeError:
        value = None
    if value is None or isinstance(param, bool) or value < 1:
        raise KernelArgumentError(f"a {name} pattern needs a {what} >= 1, got {param!r}")
    return PATTERNS[name], min(value, _MAX_PARAM)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    positions: tuple[torch.Tensor, torch.Tensor, str, int] | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Grouped-query attention of one query per row: q [B, Hq, 1, D], k / v [B, Hkv, S, D] (any strides but a
    contiguous last dim) -> [B, Hq, 1, D] in float32. Visibility: `mask` bool [B, 1, S], or `positions` =
    (query positions [B, 1], key positions [B, S], pattern name in PATTERNS, its window / chunk size) so the kernel
    needs no mask. `sinks` [Hq] (float32, or None): a learned logit per query head in the softmax denominator that
    weights no value (GPT-OSS). Hidden slots are never read; a row that sees nothing gets zeros. None when the kernel
    does not take these; KernelArgumentError for an unknown pattern or a window / chunk size below 1."""
    pattern, param = _pattern(*positions[2:]) if positions is not None else (0, 0)
    if not _eager(q) or q.dim() != 4 or q.shape[2] != 1:
        return None
    lib = _library()
    if (
        lib is None
        or not _cpu(k)
        or not _cpu(v)
        or k.dim() != 4
        or k.shape != v.shape
        or q.shape[0] != k.shape[0]
        or q.shape[-1] != k.shape[-1]
        or not _dense_last(k)
        or not _dense_last(v)
        or k.shape[1] == 0
        or q.shape[1] % k.shape[1]
        or not 0 < q.numel() <= INT_MAX
        or not 0 < k.numel() <= INT_MAX
        or not _real(scale)
        or not (softcap is None or _real(softcap) and softcap > 0)
        or not _vec(sinks, q.shape[1])
    ):
        return None  # (no size is 0 past here: each is at most its tensor's element count, a C int)
    b, hq, _, d = q.shape
    s = k.shape[2]
    if not q.is_contiguous():
        q = q.contiguous()
    qpos = kpos = m = None
    if positions is not None:
        qpos, kpos = positions[:2]
        if not _cpu(qpos, torch.int64) or not _cpu(kpos, torch.int64) or qpos.numel() != b or kpos.shape != (b, s):
            return None
        qpos, kpos = qpos.reshape(b).contiguous(), kpos.contiguous()
    elif mask is not None and _cpu(mask, torch.bool) and mask.numel() == b * s:
        m = mask.reshape(b, s).contiguous()
    else:
        return None
    out = torch.empty_like(q)
    err = lib.hc_decode_attention(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        None if m is None else m.data_ptr(),
        None if qpos is None else qpos.data_ptr(),
        None if kpos is None else kpos.data_ptr(),
        pattern,
        param,
        out.data_ptr(),
        b,
        hq,
        k.shape[1],
        s,
        d,
        *k.stride()[:3],
        *v.stride()[:3],
        scale,
        softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
    )
    if err:
        raise MemoryError(f"hc_decode_attention: no memory for its scratch ({s} slots x {hq // k.shape[1]} heads)")
    return out


def _rotary_ok(cos: torch.Tensor | None, sin: torch.Tensor | None, b: int, t: int, d: int) -> bool:
    """cos / sin: both None, or contiguous float32 CPU [B, 1, T, R] (any shape of B * T * R) with an even R <= d."""
    if cos is None or sin is None:
        return cos is None and sin is None
    r = cos.shape[-1] if cos.dim() else -1
    n = b * t * r
    return (
        _cpu(cos)
        and _cpu(sin)
        and 0 <= r <= d
        and r % 2 == 0
        and n <= INT_MAX
        and cos.numel() == n
        and sin.numel() == n
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """Rotary embedding of x [B, H, T, D] (any strides but a contiguous last dim) by cos / sin [B, 1, T, R]
    (R <= D: the first R features rotate, the rest are copied) -> a contiguous [B, H, T, D]; None when the kernel
    does not take these."""
    if not _eager(x) or x.dim() != 4 or not 0 < x.numel() <= INT_MAX or not _dense_last(x) or cos is None:
        return None
    lib = _library()
    b, h, t, d = x.shape
    if lib is None or not _rotary_ok(cos, sin, b, t, d):
        return None
    r = cos.shape[-1]
    out = torch.empty(b, h, t, d, dtype=torch.float32)
    sb, sh, st, _ = x.stride()
    lib.hc_rope(
        x.data_ptr(), sb, sh, st, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), b, h, t, d, r, int(bool(interleaved))
    )
    return out


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    z: torch.Tensor | None,
    b: torch.Tensor,
    c: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor | None,
    bias: torch.Tensor | None,
    softplus: bool,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mamba1 selective scan (see hybridcache/ops/selective_scan.py) on [B, T, Dm] / [B, T, N] layouts (any batch and
    time strides; a strided last dim is copied first): y [B, T, Dm] and the final state [B, Dm, N], float32; None
    when the kernel does not take these."""
    if not _eager(u) or u.dim() != 3 or a.dim() != 2:
        return None
    lib = _library()
    bsz, t, dm = u.shape
    n = a.shape[-1]
    if (
        lib is None
        or not 0 < u.numel() <= INT_MAX
        or not 0 < n <= INT_MAX
        or bsz * dm * n > INT_MAX
        or bsz * t * n > INT_MAX
        or not _cpu(a)
        or a.shape != (dm, n)
        or any(x is not None and not _cpu(x) for x in (delta, z, b, c, d, bias, state))
        or any(x is not None and x.shape != u.shape for x in (delta, z))
        or b.shape != (bsz, t, n)
        or c.shape != (bsz, t, n)
        or any(x is not None and x.shape != (dm,) for x in (d, bias))
        or (state is not None and state.shape != (bsz, dm, n))
    ):
        return None
    u, delta, z, b, c = (x if x is None or _dense_last(x) else x.contiguous() for x in (u, delta, z, b, c))
    a, d = a.contiguous(), None if d is None else d.contiguous()
    state = None if state is None else state.contiguous()
    # dt and the gate by torch's vectorized ops (per channel, the kernel would call log1p/exp one at a time)
    delta = delta + bias if bias is not None else delta
    delta = F.softplus(delta) if softplus else delta.contiguous()
    z = None if z is None else F.silu(z)
    y = torch.empty(bsz, t, dm, dtype=torch.float32)
    out = torch.empty(bsz, dm, n, dtype=torch.float32)
    args = []
    for x in (u, delta, z, b, c):
        args += [None, 0, 0] if x is None else [x.data_ptr(), x.stride(0), x.stride(1)]
    lib.hc_selective_scan(
        *args,
        a.data_ptr(),
        None if d is None else d.data_ptr(),
        None,
        0,
        None if state is None else state.data_ptr(),
        y.data_ptr(),
        out.data_ptr(),
        bsz,
        t,
        dm,
        n,
    )
    return y, out


def norm_rope(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    interleaved: bool,
) -> torch.Tensor | None:
    """RMSNorm over the last dim with `scale` [D] (None: no norm), then rotary by cos / sin [B, 1, T, R] (None: no
    rotary) of x [B, H, T, D] (any strides but a contiguous last dim) -> a contiguous [B, H, T, D]: a layer's q or k in
    one call. None when the kernel does not take these."""
    if not _eager(x) or x.dim() != 4 or not 0 < x.numel() <= INT_MAX or not _dense_last(x) or not _real(eps):
        return None
    lib = _library()
    b, h, t, d = x.shape
    if lib is None or not _vec(scale, d) or not _rotary_ok(cos, sin, b, t, d):
        return None
    r = 0 if cos is None else cos.shape[-1]
    out = torch.empty(b, h, t, d, dtype=torch.float32)
    sb, sh, st, _ = x.stride()
    lib.hc_norm_rope(
        x.data_ptr(),
        sb,
        sh,
        st,
        None if scale is None else scale.data_ptr(),
        eps,
        None if cos is None else cos.data_ptr(),
        None if sin is None else sin.data_ptr(),
        out.data_ptr(),
        b,
        h,
        t,
        d,
        r,
        int(bool(interleaved)),
    )
    return out
