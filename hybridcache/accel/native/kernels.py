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
and accumulates in float32 (activations are never rounded). More than MAX_ROWS rows (a prefill) go to a GEMM
kernel instead: panels of 2 vector widths of weight rows, widened once per panel into per-thread scratch, times 6
rows of x at a time (outer products, 12 vector sums in registers), K in blocks of 512. On the benchmark machine it
matches or beats MKL's float32 sgemm on Gemma 3 270M's projections at 128-2048 rows, and packed weights need no
widened copy of the matrix (a 128-token prefill: float32 424 -> 363 ms, bfloat16 458 -> 335, int8 404 -> 312).
The other kernels do a decode step's small work in one
call each where torch would dispatch 7 (RMSNorm) or ~20 (masked attention of one query) ops on a few hundred
numbers: RMSNorm, the residual add between two norms, q/k norm + rotary, a gated MLP's activation x product,
one-query attention, the Mamba1 scan, and a decoder layer's q/k/v input and everything after its attention
(cpu_fused.py). They are compiled once per machine with the C compiler
(`$CC`, else `cc`; `-O3 -march=native -fopenmp`, about a second) into $HYBRIDCACHE_HOME/kernels, and loaded only
after their manifest (the build's digest and the library's sha256) verifies: see build.py. Without a compiler,
on a machine other than x86-64, with a kernel directory other users can write, or with HYBRIDCACHE_DISABLE_KERNELS=1,
every function here returns None and callers use their torch path (the same results up to float32 rounding order);
`kernel_status()` names the path that runs.

Every wrapper checks what reaches C first: devices, dtypes, layouts (strided), shapes, strides, and sizes (each a C
int, every tensor below 2**31 elements); anything its kernel does not take returns None (the torch path), arguments
no implementation takes raise KernelArgumentError (a ValueError).

Layout, by responsibility: op_declarations.py declares every op (schema, dtype / shape rules, C signatures, variant
tables); cpu_library.py loads the library; _checks.py holds the predicates; cpu_rows.py, cpu_attention.py and
cpu_fused.py the eager wrappers; registry.py the `hybridcache::<op>` torch ops that torch.compile traces as opaque
calls of the same kernels; op_reference.py the pure-torch references. This module is the stable import path.
"""

from __future__ import annotations

from hybridcache.accel.native.attention import (  # noqa: F401 (re-exported)
    _MAX_PARAM,
    _pattern,
    _rotary_ok,
    decode_attention,
    norm_rope,
    rope,
    selective_scan,
)
from hybridcache.accel.native.build import KernelNotice  # noqa: F401 (re-exported)
from hybridcache.accel.native.checks import (  # noqa: F401 (re-exported)
    INT_MAX,
    MAX_NORM_ROWS,
    MAX_ROWS,
    KernelArgumentError,
    _cpu,
    _dense_last,
    _eager,
    _ints,
    _real,
    _vec,
)
from hybridcache.accel.native.library import SOURCE, _library, _reset, kernel_available, kernel_status  # noqa: F401
from hybridcache.accel.native.op_declarations import ACT_MUL, PATTERNS, SIGNATURES, WEIGHT_KERNELS  # noqa: F401 (re-exported)
from hybridcache.accel.native.rows import act_mul, argmax_rows, decode_linear, residual_norm, rms_norm, supports  # noqa: F401
