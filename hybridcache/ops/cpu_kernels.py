"""CPU kernels for the decode step (kernels/cpu_decode.c), compiled on first use: projections, RMSNorm, attention.

A decode step is y = x @ W^T for every weight matrix with x of only B rows, so it runs at the speed the weights
stream from memory. Measured on the 2-core benchmark machine (Gemma 3 270M's 262k x 640 tied head, 671 MB in
float32; a streaming read of it takes ~22 ms):

    rows  MKL F.linear (float32)   this kernel: float32   bfloat16 weights   int8 weights (+ per-row scale)
    1     22 ms                    21 ms                  11 ms              6.5 ms
    8     80 ms                    27 ms                  17 ms              12.5 ms

(4 KiB pages; on 2 MiB pages, see huge_pages.py, the bfloat16 read at batch 1 takes 10.7 ms.) At batch 8 the
bfloat16 / int8 reads are bound by the multiply-adds of 2 cores, not by memory.

The kernel reads each weight row once for all rows of x, widens bfloat16 / int8 weights to float32 in registers
and accumulates in float32 (activations are never rounded). The other kernels do a decode step's small work in one
call each where torch would dispatch 7 (RMSNorm) or ~20 (masked attention of one query) ops on a few hundred
numbers: RMSNorm, the residual add between two norms, q/k norm + rotary, a gated MLP's activation x product,
one-query attention, the Mamba1 scan. They are compiled once per machine with the C compiler
(`$CC`, else `cc`; `-O3 -march=native -fopenmp`, about a second) into $HYBRIDCACHE_HOME/kernels, and loaded only
after their manifest (the build's digest and the library's sha256) verifies: see _native.py. Without a compiler,
on a machine other than x86-64, with a kernel directory other users can write, or with HYBRIDCACHE_DISABLE_KERNELS=1,
every function here returns None and callers use their torch path (the same results up to float32 rounding order);
`kernel_status()` names the path that runs.

Every wrapper checks what reaches C first: devices, dtypes, layouts (strided), shapes, strides, and sizes (each a C
int, every tensor below 2**31 elements); anything its kernel does not take returns None (the torch path), arguments
no implementation takes raise KernelArgumentError (a ValueError).
"""

from __future__ import annotations

import ctypes
import operator
import threading

import torch
import torch.nn.functional as F

from hybridcache.ops._dispatch import kernels_disabled
from hybridcache.ops._native import SOURCE_DIR as _SOURCE_DIR
from hybridcache.ops._native import KernelNotice, load_library  # noqa: F401 (KernelNotice: re-exported)

SOURCE = _SOURCE_DIR / "cpu_decode.c"
MAX_ROWS = 16  # more rows than this: a real GEMM, where the BLAS is better
MAX_NORM_ROWS = 1 << 20  # rows per norm call (a prefill block of 1M tokens); split over threads when big
INT_MAX = 2**31 - 1  # every size a kernel takes is a C int; every tensor it reads or writes has fewer elements
_WEIGHT_FN = {torch.float32: "hc_linear_f32", torch.bfloat16: "hc_linear_bf16", torch.int8: "hc_linear_i8"}

_F32, _STRIDED = torch.float32, torch.strided
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
# The one declaration of the library's interface: name -> (return type, argument types). The loader refuses a
# library that lacks any of these names (torch path, one warning).
SIGNATURES: dict[str, tuple[object, list]] = {
    "hc_isa": (ctypes.c_char_p, []),
    "hc_openmp": (_I, []),
    "hc_threads": (_I, []),
    "hc_linear_f32": (None, [_P] * 5 + [_I] * 3),
    "hc_linear_bf16": (None, [_P] * 5 + [_I] * 3),
    "hc_linear_i8": (None, [_P] * 5 + [_I] * 3),
    "hc_rms_norm": (None, [_P] * 3 + [_I] * 2 + [_F]),
    "hc_residual_norm": (None, [_P] * 3 + [_F, _P, _F] + [_P] * 2 + [_I] * 2),
    "hc_act_mul": (None, [_P] * 2 + [_I] * 3),
    "hc_argmax_rows": (None, [_P] * 2 + [_I, _L]),
    "hc_gated_mlp": (None, [_P] + [_I] * 3 + [_P, _I] + [_P] * 3 + [_I] + [_P] * 2 + [_I] + [_P] * 2),
    "hc_qkv_norm_rope": (
        None,
        [_P] + [_I] * 3 + [_P, _I] + [_P] * 2 + [_I] * 3 + [_P] * 2 + [_F, _P, _F] + [_P] * 2 + [_I] * 2 + [_P] * 2,
    ),
    "hc_decode_attention": (_I, [_P] * 6 + [_I, _L, _P] + [_I] * 5 + [_L] * 6 + [_F] * 2),
    "hc_rope": (None, [_P] + [_L] * 3 + [_P] * 3 + [_I] * 6),
    "hc_norm_rope": (None, [_P] + [_L] * 3 + [_P, _F] + [_P] * 3 + [_I] * 6),
    "hc_selective_scan": (None, [_P, _L, _L] * 5 + [_P] * 3 + [_I] + [_P] * 3 + [_I] * 4),
}

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None, "status": a line saying which path runs
_LINEAR: dict[torch.dtype, object] = {}  # weight dtype -> its kernel, once loaded


class KernelArgumentError(ValueError):
    """Arguments that no implementation takes (e.g. a chunk size of 0 or an unknown pattern), refused before any
    kernel runs. Anything valid that a kernel does not take goes to the torch path instead (the wrapper's None)."""


def _load() -> ctypes.CDLL | None:
    _LINEAR.clear()
    loaded, reason = load_library("cpu_decode", SOURCE, list(SIGNATURES), disabled=kernels_disabled())
    if loaded is None:
        _state["status"] = f"torch path: {reason}"
        return None
    lib = loaded.lib
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    _LINEAR.update({dtype: getattr(lib, name) for dtype, name in _WEIGHT_FN.items()})
    threads = f"OpenMP, {lib.hc_threads()} threads" if lib.hc_openmp() else "one thread (no OpenMP)"
    note = f"; {loaded.note}" if loaded.note else ""
    _state["status"] = (
        f"C kernels: {lib.hc_isa().decode()}, {threads}, {loaded.file} (sha256-verified, built by "
        f"{loaded.compiler}){note}"
    )
    return lib


def _library() -> ctypes.CDLL | None:
    lib = _state.get("lib", _state)  # the hot path: one dict lookup once loaded
    if lib is not _state:
        return lib  # type: ignore[return-value]
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def kernel_available() -> bool:
    """Whether the kernels are built and loaded here (builds them on first call)."""
    return _library() is not None


def kernel_status() -> str:
    """One line naming the path that runs: "C kernels: <isa>, <threads>, <library> ..." or "torch path: <why>"
    (builds and verifies the kernels if needed)."""
    _library()
    return str(_state["status"])


def _reset() -> None:
    """Forget the loaded library (tests): the next call loads again, by the rules above."""
    with _lock:
        _state.clear()
        _LINEAR.clear()


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `decode_linear` takes these (CPU, float32 x of at most MAX_ROWS rows, a 2-d weight it reads)."""
    return (
        _eager(x)
        and x.dim() >= 1
        and _cpu(weight, weight.dtype)
        and weight.dim() == 2
        and weight.dtype in _WEIGHT_FN
        and x.shape[-1] == weight.shape[1]
        and _ints(*weight.shape)
        and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
    )


def _eager(x: torch.Tensor) -> bool:
    """A strided float32 CPU tensor, no autograd, not being traced by torch.compile (a kernel call writes through raw
    pointers, which a trace would run on placeholder tensors): what every wrapper here needs first."""
    return (
        x.dtype == _F32
        and x.is_cpu
        and x.layout == _STRIDED
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


def _cpu(t: torch.Tensor, dtype: torch.dtype = _F32) -> bool:
    """A strided CPU tensor of `dtype`: what a kernel may read through its data pointer (its sizes: checked by the
    caller against the sizes it passes)."""
    return t.dtype == dtype and t.is_cpu and t.layout == _STRIDED


def _vec(t: torch.Tensor | None, n: int) -> bool:
    """None, or a contiguous strided float32 CPU vector of n (n a C int: the caller's size)."""
    return t is None or (
        t.dtype == _F32 and t.shape == (n,) and t.is_cpu and t.layout == _STRIDED and t.is_contiguous()
    )


def _ints(*sizes: int) -> bool:
    """Whether every size fits a C int."""
    return all(0 <= v <= INT_MAX for v in sizes)


def _real(v) -> bool:
    """A Python / numpy real number a C float takes (eps, scale, softcap)."""
    return type(v) is float or isinstance(v, (int, float)) and not isinstance(v, bool)


def _dense_last(x: torch.Tensor) -> bool:
    """Whether the last dim is contiguous (a size-1 dim may have any stride)."""
    return x.shape[-1] <= 1 or x.stride(-1) == 1


# The wrappers below run once per projection / norm / layer of every decode step: checks are ordered cheapest first
# and each returns None (the caller's torch path) for anything its kernel does not take.


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x [..., K] @ weight[N, K]^T (* scale [N]) (+ bias [N]) -> [..., N] float32, by the kernel; None when the
    kernel cannot take these tensors (see `supports`; contiguous float32 scale / bias of N) or is unavailable."""
    if not _eager(x) or x.dim() == 0 or _library() is None:
        return None
    fn = _LINEAR.get(weight.dtype)
    if (
        fn is None
        or weight.dim() != 2
        or not weight.is_cpu
        or weight.layout != torch.strided
        or not weight.is_contiguous()
    ):
        return None
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if x.shape[-1] != k or not 0 < rows <= MAX_ROWS or n > INT_MAX or k > INT_MAX:
        return None
    if not (_vec(scale, n) and _vec(bias, n)):
        return None
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    fn(
        x.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        None if scale is None else scale.data_ptr(),
        None if bias is None else bias.data_ptr(),
        rows,
        n,
        k,
    )
    return out


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., D] * rsqrt(mean(x^2) + eps) * scale [D] in float32 (a norm's effective scale, e.g. 1 + weight); None
    when the kernel does not take these (not float32 CPU, autograd on, more than MAX_NORM_ROWS rows)."""
    if not _eager(x) or x.dim() == 0 or not _real(eps):
        return None
    lib = _library()
    d = x.shape[-1]
    if lib is None or scale is None or not _vec(scale, d) or not 0 < x.numel() <= min(MAX_NORM_ROWS * d, INT_MAX):
        return None
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    lib.hc_rms_norm(x.data_ptr(), scale.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
    return out


def residual_norm(
    h: torch.Tensor, x: torch.Tensor, post: tuple[torch.Tensor, float] | None, nxt: tuple[torch.Tensor, float] | None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """h + rms_norm(x) * post scale (x itself when `post` is None), and the RMSNorm of that sum by `nxt` (None: not
    computed): a residual add between two norms in one call. `post` / `nxt`: (effective scale [D], eps). None when
    the kernel does not take these (h and x [..., D] float32 of one shape)."""
    if not _eager(x) or not _eager(h) or h.shape != x.shape or x.dim() == 0:
        return None
    lib = _library()
    d = x.shape[-1]
    for norm in (post, nxt):
        if norm is not None and (norm[0] is None or not _vec(norm[0], d) or not _real(norm[1])):
            return None
    if lib is None or not 0 < x.numel() <= min(MAX_NORM_ROWS * d, INT_MAX):
        return None
    h, x = h.contiguous(), x.contiguous()
    h_out = torch.empty_like(h)
    n_out = None if nxt is None else torch.empty_like(h)
    lib.hc_residual_norm(
        h.data_ptr(),
        x.data_ptr(),
        None if post is None else post[0].data_ptr(),
        0.0 if post is None else post[1],
        None if nxt is None else nxt[0].data_ptr(),
        0.0 if nxt is None else nxt[1],
        h_out.data_ptr(),
        None if n_out is None else n_out.data_ptr(),
        x.numel() // d,
        d,
    )
    return h_out, n_out


ACT_MUL = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}  # activations hc_act_mul computes


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
    """act(gate) * up from a fused gate / up projection [..., 2I] (gate first) -> [..., I], for the activations in
    ACT_MUL; None when the kernel does not take these."""
    code = ACT_MUL.get(act) if isinstance(act, str) else None
    if code is None or not _eager(gate_up) or gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        return None
    lib = _library()
    two_i = gate_up.shape[-1]
    if lib is None or not 0 < gate_up.numel() <= min(MAX_NORM_ROWS * two_i, INT_MAX):
        return None
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], two_i // 2, dtype=torch.float32)
    lib.hc_act_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // two_i, two_i // 2, code)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x [B, V].argmax(-1) as torch computes it (the first largest; the first NaN if any) by the kernel: ~20x faster
    than torch on a 262k-token vocabulary (0.44 ms per row there). None when the kernel does not take x."""
    if not _eager(x) or x.dim() != 2 or not 0 < x.shape[1] or x.shape[0] == 0 or x.numel() > INT_MAX:
        return None
    lib = _library()
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.hc_argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out


PATTERNS = {"full": 0, "sliding": 1, "chunked": 2}  # what hc_decode_attention evaluates itself from positions
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
) -> torch.Tensor | None:
    """Grouped-query attention of one query per row: q [B, Hq, 1, D], k / v [B, Hkv, S, D] (any strides but a
    contiguous last dim) -> [B, Hq, 1, D] in float32. Visibility: `mask` bool [B, 1, S], or `positions` =
    (query positions [B, 1], key positions [B, S], pattern name in PATTERNS, its window / chunk size) so the kernel
    needs no mask. Hidden slots are never read; a row that sees nothing gets zeros. None when the kernel does not
    take these; KernelArgumentError for an unknown pattern or a window / chunk size below 1."""
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
