"""CPU kernels for the decode step (kernels/cpu_decode.c), compiled on first use: projections, RMSNorm, attention.

A decode step is y = x @ W^T for every weight matrix with x of only B rows, so it runs at the speed the weights
stream from memory. Measured on the 2-core benchmark machine (Gemma 3 270M's 262k x 640 tied head, 671 MB in
float32; a streaming read of it takes ~22 ms):

    rows  MKL F.linear (float32)   this kernel: float32   bfloat16 weights   int8 weights (+ per-row scale)
    1     22 ms                    21 ms                  11 ms              6.5 ms
    8     80 ms                    26 ms                  19 ms              15 ms

The kernel reads each weight row once for all rows of x, widens bfloat16 / int8 weights to float32 in registers
and accumulates in float32 (activations are never rounded). The other kernels do a decode step's small work in one
call each where torch would dispatch 7 (RMSNorm) or ~20 (masked attention of one query) ops on a few hundred
numbers. They are compiled once per machine with the C compiler
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

from hybridcache.ops._dispatch import kernels_disabled
from hybridcache.paths import home_dir

SOURCE = Path(__file__).with_name("kernels") / "cpu_decode.c"
MAX_ROWS = 16  # more rows than this: a real GEMM, where the BLAS is better
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
LIBS = ["-lm"]
MAX_NORM_ROWS = 256  # the norm kernel is one thread: bigger blocks (prefill) keep torch's threaded ops
_WEIGHT_FN = {torch.float32: "hc_linear_f32", torch.bfloat16: "hc_linear_bf16", torch.int8: "hc_linear_i8"}

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None, "status": a line saying which


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
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    for name in _WEIGHT_FN.values():
        fn = getattr(lib, name)
        fn.argtypes = [pointer, pointer, pointer, pointer, pointer, integer, integer, integer]
        fn.restype = None
    lib.hc_isa.restype = ctypes.c_char_p
    lib.hc_rms_norm.argtypes = [pointer, pointer, pointer, integer, integer, ctypes.c_float]
    lib.hc_rms_norm.restype = None
    lib.hc_decode_attention.argtypes = [pointer] * 5 + [integer] * 5 + [ctypes.c_long] * 6 + [ctypes.c_float] * 2
    lib.hc_decode_attention.restype = None
    _state["status"] = f"{lib.hc_isa().decode()} kernel ({target.name})"
    return lib


def _library() -> ctypes.CDLL | None:
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


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] @ weight[N, K]^T (* scale [N]) (+ bias [N]) -> [..., N] float32, by the kernel; None when the
    kernel cannot take these tensors (see `supports`) or is unavailable: the caller then uses torch."""
    if not supports(x, weight):
        return None
    lib = _library()
    if lib is None:
        return None
    n, k = weight.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if not weight.is_contiguous():
        return None
    extras = []
    for t in (scale, bias):
        if t is not None and (t.dtype != torch.float32 or t.shape != (n,) or not t.is_contiguous()):
            return None
        extras.append(t.data_ptr() if t is not None else None)
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    getattr(lib, _WEIGHT_FN[weight.dtype])(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), extras[0], extras[1],
                                            rows.shape[0], n, k)
    return out.view(*lead, n)


def _cpu_float32(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and not torch.is_grad_enabled()


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., D] * rsqrt(mean(x^2) + eps) * scale [D] in float32 (a norm's effective scale, e.g. 1 + weight); None
    when the kernel does not take these (not float32 CPU, autograd on, more than MAX_NORM_ROWS rows)."""
    d = x.shape[-1]
    if (not _cpu_float32(x, scale) or scale.shape != (d,) or x.numel() > MAX_NORM_ROWS * d or x.numel() == 0
            or not scale.is_contiguous()):
        return None
    lib = _library()
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.hc_rms_norm(x.data_ptr(), scale.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float | None) -> torch.Tensor | None:
    """Grouped-query attention of one query per row: q [B, Hq, 1, D], k / v [B, Hkv, S, D] (any strides but a
    contiguous last dim), mask bool [B, 1, S] -> [B, Hq, 1, D] in float32. Hidden slots are never read; a row that
    sees nothing gets zeros. None when the kernel does not take these."""
    if q.dim() != 4 or q.shape[2] != 1 or not _cpu_float32(q, k, v) or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        return None
    if k.stride(-1) != 1 or v.stride(-1) != 1 or mask.dtype != torch.bool or q.shape[1] % k.shape[1]:
        return None
    lib = _library()
    if lib is None:
        return None
    b, hq, _, d = q.shape
    s = k.shape[2]
    q = q.contiguous()
    m = mask.reshape(b, s).contiguous()
    out = torch.empty_like(q)
    lib.hc_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), m.data_ptr(), out.data_ptr(), b, hq,
                            k.shape[1], s, d, *k.stride()[:3], *v.stride()[:3], scale, softcap or 0.0)
    return out
