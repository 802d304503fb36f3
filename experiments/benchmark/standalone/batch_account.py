"""Where a batch-8 decode step's time goes on this CPU (issue 43 item 6): the projections' GEMMs against their read
roofline and their compute ceiling, and what the rest of the step costs.

One thread, timed by its own CPU time (time.thread_time), so the time a shared host gives other processes does not
count. Per weight format of the real Gemma 3 270M:
1. the whole greedy decode at batch 8 (8 rows of a 16-token prompt, `--tokens` new tokens): ms a step, and the
   roofline share (the weights a step reads, against this thread's streaming read of 1 GiB measured between runs);
2. every projection of the model (each DecodeLinear and the tied head) called once with 8 rows through `linear`, the
   kernels a step runs: their summed time is the GEMM part of a step, the rest (attention, norms, rotary, sampling,
   the interpreter) the remainder;
3. the head's GEMM (262144 x 640, 80% of the weights' bytes in float32) at batch 8 from DRAM and on an L3-resident
   slice: its compute ceiling (GFLOP/s) beside the read roofline, which says whether the format is memory- or
   compute-bound at batch 8 on this host.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m experiments.benchmark.standalone.batch_account [--formats float32 bfloat16
int8]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch

from experiments.benchmark.standalone.gemv_roofline import compile_probe, per_call
from hybridcache.accel.huge_pages import collapse

BATCH, HEAD_ROWS, K = 8, 262144, 640
CACHED_BYTES = 4 << 20  # a head slice that stays in the L3 cache: the GEMM with (almost) no DRAM in the way
PEAK = r"""
#include <immintrin.h>
/* n iterations of 10 independent 8-wide FMA chains in registers (an array of them would spill): this core's
   float32 FMA throughput, 160 flops an iteration */
float fma_peak(long n) {
  __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-3f);
  __m256 a0 = _mm256_set1_ps(0), a1 = _mm256_set1_ps(1), a2 = _mm256_set1_ps(2), a3 = _mm256_set1_ps(3);
  __m256 a4 = _mm256_set1_ps(4), a5 = _mm256_set1_ps(5), a6 = _mm256_set1_ps(6), a7 = _mm256_set1_ps(7);
  __m256 a8 = _mm256_set1_ps(8), a9 = _mm256_set1_ps(9);
  for (long i = 0; i < n; i++) {
    a0 = _mm256_fmadd_ps(a0, x, y); a1 = _mm256_fmadd_ps(a1, x, y); a2 = _mm256_fmadd_ps(a2, x, y);
    a3 = _mm256_fmadd_ps(a3, x, y); a4 = _mm256_fmadd_ps(a4, x, y); a5 = _mm256_fmadd_ps(a5, x, y);
    a6 = _mm256_fmadd_ps(a6, x, y); a7 = _mm256_fmadd_ps(a7, x, y); a8 = _mm256_fmadd_ps(a8, x, y);
    a9 = _mm256_fmadd_ps(a9, x, y);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  s = _mm256_add_ps(s, _mm256_add_ps(a8, a9));
  float o[8];
  _mm256_storeu_ps(o, s);
  return o[0];
}
"""


def projections(model) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """(weight, bias, scale) of every projection a decode step runs once: each DecodeLinear, and the head."""
    from hybridcache.nn.core.linear import DecodeLinear

    found, seen = [], set()
    for module in model.modules():
        if isinstance(module, DecodeLinear) and module.weight.data_ptr() not in seen:
            seen.add(module.weight.data_ptr())
            found.append((module.weight, module.bias, module._buffers.get("scale")))
    return found


def gemm_seconds(weights, rows: int, reps: int = 3) -> float:
    """Thread CPU seconds of one pass over every projection with `rows` rows (median of reps)."""
    from hybridcache.nn.core.linear import linear

    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _, _ in weights}
    for w, b, s in weights:
        linear(xs[w.shape[1]], w, b, s)
    times = []
    for _ in range(reps):
        start = time.thread_time()
        for w, b, s in weights:
            linear(xs[w.shape[1]], w, b, s)
        times.append(time.thread_time() - start)
    return statistics.median(times)


def head_rates(weight: torch.Tensor, scale, rows: int) -> tuple[float, float]:
    """(GFLOP/s from DRAM, GFLOP/s on a 4 MiB slice that stays in L3) of the head's GEMM with `rows` rows."""
    from hybridcache.nn.core.linear import linear

    x = torch.randn(rows, weight.shape[1])
    n = weight.shape[0]
    dram = per_call(linear, (x, weight, None, scale), 0.5, 3)
    m = CACHED_BYTES // (weight.shape[1] * weight.element_size())
    small_w, small_s = weight[:m].clone(), None if scale is None else scale[:m].clone()
    l2 = per_call(linear, (x, small_w, None, small_s), 0.3, 20)
    flops = 2 * rows * weight.shape[1]
    return flops * n / dram / 1e9, flops * m / l2 / 1e9


def account(fmt: str | None, tokens: int, probe, buf) -> dict:
    import hybridcache as hc
    from experiments.benchmark.roofline import weight_read_bytes
    from hybridcache.checkpoints.real import real_checkpoint

    model = hc.from_pretrained(real_checkpoint("gemma3_270m", quiet=True), weights=fmt)
    nbytes = weight_read_bytes(model)["weights"]
    prompt = torch.randint(10, 1000, (BATCH, 16), generator=torch.Generator().manual_seed(0))
    read = (ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.numel() * 4))
    steps, reads = [], []
    with torch.no_grad():
        hc.generate(model, prompt, max_new_tokens=4, output_logits=False)
        for _ in range(3):
            reads.append(buf.numel() * 4 / per_call(probe.read_bytes, read, 0.0, 1))
            start = time.thread_time()
            hc.generate(model, prompt, max_new_tokens=tokens, output_logits=False)
            steps.append((time.thread_time() - start) / tokens)
        weights = projections(model)
        gemm = gemm_seconds(weights, BATCH)
        gemm1 = gemm_seconds(weights, 1)
        head = max(weights, key=lambda t: t[0].shape[0])
        dram, l2 = head_rates(head[0], head[2], BATCH)
    step, rate = statistics.median(steps), statistics.median(reads)
    return {
        "weights": fmt or "float32",
        "step_ms": step * 1e3,
        "roofline_ms": nbytes / rate * 1e3,
        "of_roofline": nbytes / rate / step,
        "gemm_ms": gemm * 1e3,
        "gemm_batch1_ms": gemm1 * 1e3,
        "rest_ms": (step - gemm) * 1e3,
        "head_gflops_dram": dram,
        "head_gflops_l2": l2,
        "read_gbs": rate / 1e9,
        "weight_mb": nbytes / 1e6,
        "projection_weights": sum(w.numel() for w, _, _ in weights),
    }


def fma_peak_gflops(tmp: Path) -> float:
    """This thread's measured float32 FMA throughput (GFLOP/s), compiled here from PEAK."""
    import subprocess

    (tmp / "peak.c").write_text(PEAK)
    cmd = ["cc", "-O2", "-mavx2", "-mfma", "-shared", "-fPIC", str(tmp / "peak.c"), "-o", str(tmp / "peak.so")]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(tmp / "peak.so"))
    lib.fma_peak.restype, n = ctypes.c_float, 20_000_000
    seconds = min(per_call(lib.fma_peak, (ctypes.c_long(n),), 0.0, 1) for _ in range(3))
    return n * 10 * 8 * 2 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "int8"])
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    buf = torch.ones(1 << 28)  # 1 GiB [N]: the read roofline's buffer
    collapse([buf])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        probe = compile_probe(Path(tmp))
        peak = fma_peak_gflops(Path(tmp))
        print(f"float32 FMA peak of this thread: {peak:.1f} GFLOP/s", flush=True)
        for fmt in args.formats:
            r = account(None if fmt == "float32" else fmt, args.tokens, probe, buf)
            rows.append(r)
            print(r, flush=True)
    print(
        "| weights | step ms | roofline ms | of roofline | GEMMs ms (batch 1) | rest ms | head GFLOP/s DRAM / L3 |"
        "\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['weights']} | {r['step_ms']:.1f} | {r['roofline_ms']:.1f} | {r['of_roofline']:.0%} | "
            f"{r['gemm_ms']:.1f} ({r['gemm_batch1_ms']:.1f}) | {r['rest_ms']:.1f} | "
            f"{r['head_gflops_dram']:.1f} / {r['head_gflops_l2']:.1f} |"
        )
    step_flops = 2 * BATCH * rows[0]["projection_weights"]  # a multiply and an add per weight and row
    print(
        f"A batch-{BATCH} step's projections are {step_flops / 1e9:.1f} GFLOP: at the FMA peak ({peak:.0f} GFLOP/s) "
        f"they take {step_flops / peak / 1e6:.1f} ms on this thread at least"
    )


if __name__ == "__main__":
    main()
