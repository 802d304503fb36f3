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
(`$CC`, else `cc`; `-O3 -march=native -fopenmp`, about a second) into $HYBRIDCACHE_HOME/kernels, keyed by the
source, the compiler and the CPU. Without a compiler, or with HYBRIDCACHE_DISABLE_KERNELS=1, every function here
returns None and callers use their torch path (the same results up to float32 rounding order).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridcache.ops._dispatch import kernels_disabled
from hybridcache.paths import home_dir

SOURCE = Path(__file__).with_name("kernels") / "cpu_decode.c"
MAX_ROWS = 16  # more rows than this: a real GEMM, where the BLAS is better
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
LIBS = ["-lm"]
MAX_NORM_ROWS = 1 << 20  # rows per norm call (a prefill block of 1M tokens); split over threads when big
_WEIGHT_FN = {torch.float32: "hc_linear_f32", torch.bfloat16: "hc_linear_bf16", torch.int8: "hc_linear_i8"}

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None, "status": a line saying which
_LINEAR: dict[torch.dtype, object] = {}  # weight dtype -> its kernel, once loaded


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _compile(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # compile aside, then rename: no half-written .so
        out = Path(tmp) / target.name
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out), *LIBS], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(out, target)


def _load() -> ctypes.CDLL | None:
    if kernels_disabled():
        _state["status"] = "off (HYBRIDCACHE_DISABLE_KERNELS is set): torch's F.linear"
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        _state["status"] = "unavailable (no C compiler found: set CC): torch's F.linear"
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = "\n".join([SOURCE.read_text(), version, _cpu_signature(), *FLAGS, *LIBS])
        target = home_dir("kernels", f"cpu_decode-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so")
        if not target.is_file():
            _compile(cc, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"hybridcache: the CPU decode kernel did not build ({detail.strip()[:300]}); using torch's "
                      "F.linear instead", stacklevel=3)
        _state["status"] = "unavailable (the build failed): torch's F.linear"
        return None
    pointer, integer, long, real = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    signatures = {
        "hc_linear_f32": [pointer] * 5 + [integer] * 3, "hc_linear_bf16": [pointer] * 5 + [integer] * 3,
        "hc_linear_i8": [pointer] * 5 + [integer] * 3,
        "hc_rms_norm": [pointer] * 3 + [integer] * 2 + [real],
        "hc_residual_norm": [pointer] * 3 + [real, pointer, real] + [pointer] * 2 + [integer] * 2,
        "hc_act_mul": [pointer] * 2 + [integer] * 3,
        "hc_argmax_rows": [pointer] * 2 + [integer, long],
        "hc_gated_mlp": [pointer] + [integer] * 3 + [pointer, integer] + [pointer] * 3 + [integer] + [pointer] * 2
                        + [integer] + [pointer] * 2,
        "hc_qkv_norm_rope": [pointer] + [integer] * 3 + [pointer, integer] + [pointer] * 2 + [integer] * 3
                            + [pointer] * 2 + [real, pointer, real] + [pointer] * 2 + [integer] * 2 + [pointer] * 2,
        "hc_decode_attention": [pointer] * 6 + [integer, long, pointer] + [integer] * 5 + [long] * 6 + [real] * 2,
        "hc_rope": [pointer] + [long] * 3 + [pointer] * 3 + [integer] * 6,
        "hc_norm_rope": [pointer] + [long] * 3 + [pointer, real] + [pointer] * 3 + [integer] * 6,
        "hc_selective_scan": ([pointer, long, long] * 5 + [pointer] * 3 + [integer] + [pointer] * 3
                              + [integer] * 4),
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.hc_isa.restype = ctypes.c_char_p
    _LINEAR.update({dtype: getattr(lib, name) for dtype, name in _WEIGHT_FN.items()})
    _state["status"] = f"{lib.hc_isa().decode()} kernel ({target.name})"
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
    """One line: which CPU decode kernels this process uses (builds them if needed)."""
    _library()
    return str(_state["status"])


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `decode_linear` takes these (CPU, float32 x of at most MAX_ROWS rows, a 2-d weight it reads)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.dtype in _WEIGHT_FN and x.shape[-1] == weight.shape[1]
            and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and not torch.is_grad_enabled())


def _eager(x: torch.Tensor) -> bool:
    """Float32 on CPU, no autograd, not being traced by torch.compile (a kernel call writes through raw pointers,
    which a trace would run on placeholder tensors): what every wrapper here needs first."""
    return x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _dense_last(x: torch.Tensor) -> bool:
    """Whether the last dim is contiguous (a size-1 dim may have any stride)."""
    return x.shape[-1] <= 1 or x.stride(-1) == 1


# The wrappers below run once per projection / norm / layer of every decode step: checks are ordered cheapest first
# and each returns None (the caller's torch path) for anything its kernel does not take.

def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ weight[N, K]^T (* scale [N]) (+ bias [N]) -> [..., N] float32, by the kernel; None when the
    kernel cannot take these tensors (see `supports`; contiguous float32 scale / bias of N) or is unavailable."""
    if not _eager(x) or _library() is None:
        return None
    fn = _LINEAR.get(weight.dtype)
    if fn is None or weight.dim() != 2 or not weight.is_cpu or not weight.is_contiguous():
        return None
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if x.shape[-1] != k or not 0 < rows <= MAX_ROWS:
        return None
    for t in (scale, bias):
        if t is not None and (t.dtype != torch.float32 or t.shape != (n,) or not t.is_contiguous() or not t.is_cpu):
            return None
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), None if scale is None else scale.data_ptr(),
       None if bias is None else bias.data_ptr(), rows, n, k)
    return out


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., D] * rsqrt(mean(x^2) + eps) * scale [D] in float32 (a norm's effective scale, e.g. 1 + weight); None
    when the kernel does not take these (not float32 CPU, autograd on, more than MAX_NORM_ROWS rows)."""
    if not _eager(x):
        return None
    lib = _library()
    d = x.shape[-1]
    if (lib is None or scale.dtype != torch.float32 or scale.shape != (d,) or not scale.is_contiguous()
            or not 0 < x.numel() <= MAX_NORM_ROWS * d):
        return None
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    lib.hc_rms_norm(x.data_ptr(), scale.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
    return out


def residual_norm(h: torch.Tensor, x: torch.Tensor, post: tuple[torch.Tensor, float] | None,
                  nxt: tuple[torch.Tensor, float] | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """h + rms_norm(x) * post scale (x itself when `post` is None), and the RMSNorm of that sum by `nxt` (None: not
    computed): a residual add between two norms in one call. `post` / `nxt`: (effective scale [D], eps). None when
    the kernel does not take these (h and x [..., D] float32 of one shape)."""
    if not _eager(x) or h.dtype != torch.float32 or h.shape != x.shape:
        return None
    lib = _library()
    d = x.shape[-1]
    for norm in (post, nxt):
        if norm is not None and (norm[0].dtype != torch.float32 or norm[0].shape != (d,)
                                 or not norm[0].is_contiguous()):
            return None
    if lib is None or not 0 < x.numel() <= MAX_NORM_ROWS * d:
        return None
    h, x = h.contiguous(), x.contiguous()
    h_out = torch.empty_like(h)
    n_out = None if nxt is None else torch.empty_like(h)
    lib.hc_residual_norm(h.data_ptr(), x.data_ptr(), None if post is None else post[0].data_ptr(),
                         0.0 if post is None else post[1], None if nxt is None else nxt[0].data_ptr(),
                         0.0 if nxt is None else nxt[1], h_out.data_ptr(), None if n_out is None else n_out.data_ptr(),
                         x.numel() // d, d)
    return h_out, n_out


ACT_MUL = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}  # activations hc_act_mul computes


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor | None:
    """act(gate) * up from a fused gate / up projection [..., 2I] (gate first) -> [..., I], for the activations in
    ACT_MUL; None when the kernel does not take these."""
    code = ACT_MUL.get(act)
    if code is None or not _eager(gate_up) or gate_up.shape[-1] % 2:
        return None
    lib = _library()
    two_i = gate_up.shape[-1]
    if lib is None or not 0 < gate_up.numel() <= MAX_NORM_ROWS * two_i:
        return None
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], two_i // 2, dtype=torch.float32)
    lib.hc_act_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // two_i, two_i // 2, code)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x [B, V].argmax(-1) as torch computes it (the first largest; the first NaN if any) by the kernel: ~20x faster
    than torch on a 262k-token vocabulary (0.44 ms per row there). None when the kernel does not take x."""
    if not _eager(x) or x.dim() != 2 or not 0 < x.shape[1] < 2**31 or x.shape[0] == 0:
        return None
    lib = _library()
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.hc_argmax_rows(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out


PATTERNS = {"full": 0, "sliding": 1, "chunked": 2}  # what hc_decode_attention evaluates itself from positions


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     softcap: float | None, positions: tuple[torch.Tensor, torch.Tensor, str, int] | None = None,
                     ) -> torch.Tensor | None:
    """Grouped-query attention of one query per row: q [B, Hq, 1, D], k / v [B, Hkv, S, D] (any strides but a
    contiguous last dim) -> [B, Hq, 1, D] in float32. Visibility: `mask` bool [B, 1, S], or `positions` =
    (query positions [B, 1], key positions [B, S], pattern name in PATTERNS, its window / chunk size) so the kernel
    needs no mask. Hidden slots are never read; a row that sees nothing gets zeros. None when the kernel does not
    take these."""
    if not _eager(q) or q.dim() != 4 or q.shape[2] != 1:
        return None
    lib = _library()
    if (lib is None or k.dtype != torch.float32 or v.dtype != torch.float32 or k.shape != v.shape
            or q.shape[-1] != k.shape[-1] or not _dense_last(k) or not _dense_last(v) or q.shape[1] % k.shape[1]):
        return None
    b, hq, _, d = q.shape
    s = k.shape[2]
    if not q.is_contiguous():
        q = q.contiguous()
    qpos = kpos = m = None
    pattern, param = 0, 0
    if positions is not None:
        qpos, kpos, name, param = positions
        pattern = PATTERNS[name]
        if qpos.dtype != torch.int64 or kpos.dtype != torch.int64 or kpos.shape != (b, s):
            return None
        qpos, kpos = qpos.reshape(b).contiguous(), kpos.contiguous()
    elif mask is not None and mask.dtype == torch.bool and mask.numel() == b * s:
        m = mask.reshape(b, s).contiguous()
    else:
        return None
    out = torch.empty_like(q)
    lib.hc_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if m is None else m.data_ptr(),
                            None if qpos is None else qpos.data_ptr(), None if kpos is None else kpos.data_ptr(),
                            pattern, int(param or 0), out.data_ptr(), b, hq, k.shape[1], s, d, *k.stride()[:3],
                            *v.stride()[:3], scale, softcap or 0.0)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """Rotary embedding of x [B, H, T, D] (any strides but a contiguous last dim) by cos / sin [B, 1, T, R]
    (R <= D: the first R features rotate, the rest are copied) -> a contiguous [B, H, T, D]; None when the kernel
    does not take these."""
    if not _eager(x) or x.dim() != 4 or not _dense_last(x):
        return None
    lib = _library()
    b, h, t, d = x.shape
    r = cos.shape[-1]
    if (lib is None or cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.numel() != b * t * r
            or sin.numel() != b * t * r or r > d or r % 2 or not cos.is_contiguous() or not sin.is_contiguous()):
        return None
    out = torch.empty(b, h, t, d, dtype=torch.float32)
    sb, sh, st, _ = x.stride()
    lib.hc_rope(x.data_ptr(), sb, sh, st, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), b, h, t, d, r,
                int(interleaved))
    return out


def selective_scan(u: torch.Tensor, delta: torch.Tensor, z: torch.Tensor | None, b: torch.Tensor, c: torch.Tensor,
                   a: torch.Tensor, d: torch.Tensor | None, bias: torch.Tensor | None, softplus: bool,
                   state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mamba1 selective scan (see hybridcache/ops/selective_scan.py) on [B, T, Dm] / [B, T, N] layouts (any batch and
    time strides; a strided last dim is copied first): y [B, T, Dm] and the final state [B, Dm, N], float32; None
    when the kernel does not take these."""
    if not _eager(u) or u.dim() != 3:
        return None
    lib = _library()
    bsz, t, dm = u.shape
    n = a.shape[-1]
    u, delta, z, b, c = (x if x is None or _dense_last(x) else x.contiguous() for x in (u, delta, z, b, c))
    three = [x for x in (u, delta, z) if x is not None]
    if (lib is None or any(x.shape != u.shape or x.dtype != torch.float32 for x in three)
            or any(x.shape != (bsz, t, n) or x.dtype != torch.float32 for x in (b, c))
            or a.shape != (dm, n) or a.dtype != torch.float32
            or any(x is not None and (x.shape != (dm,) or x.dtype != torch.float32) for x in (d, bias))
            or (state is not None and (state.shape != (bsz, dm, n) or state.dtype != torch.float32))):
        return None
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
    lib.hc_selective_scan(*args, a.data_ptr(), None if d is None else d.data_ptr(), None, 0,
                          None if state is None else state.data_ptr(), y.data_ptr(), out.data_ptr(), bsz, t, dm, n)
    return y, out


def norm_rope(x: torch.Tensor, scale: torch.Tensor | None, eps: float, cos: torch.Tensor | None,
              sin: torch.Tensor | None, interleaved: bool) -> torch.Tensor | None:
    """RMSNorm over the last dim with `scale` [D] (None: no norm), then rotary by cos / sin [B, 1, T, R] (None: no
    rotary) of x [B, H, T, D] (any strides but a contiguous last dim) -> a contiguous [B, H, T, D]: a layer's q or k in
    one call. None when the kernel does not take these."""
    if not _eager(x) or x.dim() != 4 or not _dense_last(x):
        return None
    lib = _library()
    b, h, t, d = x.shape
    r = 0 if cos is None else cos.shape[-1]
    if lib is None or (scale is not None and (scale.dtype != torch.float32 or scale.shape != (d,)
                                              or not scale.is_contiguous())):
        return None
    if cos is not None and (cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.numel() != b * t * r
                            or sin.numel() != b * t * r or r > d or r % 2 or not cos.is_contiguous()
                            or not sin.is_contiguous()):
        return None
    out = torch.empty(b, h, t, d, dtype=torch.float32)
    sb, sh, st, _ = x.stride()
    lib.hc_norm_rope(x.data_ptr(), sb, sh, st, None if scale is None else scale.data_ptr(), eps,
                     None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), out.data_ptr(),
                     b, h, t, d, r, int(interleaved))
    return out
