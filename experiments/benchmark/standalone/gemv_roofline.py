"""Where the batch-1 GEMV's time goes: per weight type, on one thread, the decode kernel against a plain read of the
same bytes, from DRAM and from L2.

For float32 / bfloat16 / int8 / q8_0 weights (Gemma 3 270M's head, 262144 x 640, on 2 MiB pages) each round times
(1) a read-only stream of the matrix's bytes (integer adds of every 32-byte vector: the read roofline for exactly
these bytes, no floating point), (2) hc_linear_* at batch 1 over it, then both again over a 512 KiB matrix that stays
in L2 (called back to back): the kernel's compute ceiling, with no DRAM in the way. One thread, timed by its own CPU
time (time.thread_time), so the time a shared host gives other processes does not count; rounds alternate, so both
see the same conditions. The read probe is compiled here from the C below (never part of the kernels' library).
`--decode`: then the whole batch-1 greedy decode of the real Gemma 3 270M at each weight format (64 new tokens after
a 16-token prompt, per token) against the same thread's read of 1 GiB between runs: the decode's roofline share.

    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/benchmark/standalone/gemv_roofline.py [--rounds 4] [--decode]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from hybridcache.accel.huge_pages import collapse
from hybridcache.accel.native import kernels as ck

PROBE = r"""
#include <immintrin.h>
#include <stddef.h>
long long read_bytes(const unsigned char *p, size_t n) { /* n: a multiple of 128 */
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 128) {
    a0 = _mm256_add_epi32(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
    a1 = _mm256_add_epi32(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
    a2 = _mm256_add_epi32(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
    a3 = _mm256_add_epi32(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
  }
  int o[8];
  _mm256_storeu_si256((__m256i *)o, _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)));
  long long s = 0;
  for (int j = 0; j < 8; j++) s += o[j];
  return s;
}
"""
K, N, L2_BYTES = 640, 262144, 512 * 1024  # the small matrix: half of a 1 MiB L2
# format -> (kernel, bytes per weight as the read roofline counts them: q8_0 reads a float16 scale per 32 weights)
FORMATS = {
    "float32": ("hc_linear_f32", 4),
    "bfloat16": ("hc_linear_bf16", 2),
    "int8": ("hc_linear_i8", 1),
    "q8_0": ("hc_linear_q8_0", 1),
}


def compile_probe(tmp: Path) -> ctypes.CDLL:
    (tmp / "probe.c").write_text(PROBE)
    cmd = ["cc", "-O2", "-mavx2", "-shared", "-fPIC", str(tmp / "probe.c"), "-o", str(tmp / "probe.so")]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(tmp / "probe.so"))
    lib.read_bytes.restype = ctypes.c_longlong
    return lib


def matrix(fmt: str, rows: int, g: torch.Generator) -> torch.Tensor:
    if fmt in ("int8", "q8_0"):
        return torch.randint(-127, 128, (rows, K), generator=g, dtype=torch.int8)
    w = torch.randn(rows, K, generator=g)
    return w.to(torch.bfloat16) if fmt == "bfloat16" else w


def per_call(fn, args: tuple, min_s: float, min_calls: int) -> float:
    """Seconds of this thread's CPU time per call of fn(*args) (one untimed call first)."""
    fn(*args)
    calls, start = 0, time.thread_time()
    while calls < min_calls or time.thread_time() - start < min_s:
        fn(*args)
        calls += 1
    return (time.thread_time() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--decode", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lib = ck._library()
    if lib is None:
        raise SystemExit(f"no C kernels here: {ck.kernel_status()}")
    print(ck.kernel_status())
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        probe = compile_probe(Path(tmp))
        ptr, c_int = ctypes.c_void_p, ctypes.c_int
        for fmt, (name, size) in FORMATS.items():
            small_rows = L2_BYTES // (K * size) // 4 * 4
            big, small = matrix(fmt, N, g), matrix(fmt, small_rows, g)
            collapse([big])
            x, scale = torch.randn(1, K, generator=g), torch.rand(N, generator=g) if fmt == "int8" else None
            if fmt == "q8_0":  # its scales: a float16 per block of 32, read as part of the stream
                scale, small_scale = (torch.rand(r, K // 32, generator=g).half() for r in (N, small_rows))
            y = torch.empty(1, N)
            kernel = getattr(lib, name)
            rates: dict[str, list[float]] = {k: [] for k in ("read", "gemv", "read L2", "gemv L2")}
            for _ in range(args.rounds):
                for key, w, rows, min_s, min_calls in (("", big, N, 0.3, 3), (" L2", small, small_rows, 0.15, 50)):
                    nbytes = wbytes = rows * K * size  # what the kernel reads; the probe reads the weights
                    sc = ptr(scale.data_ptr()) if scale is not None else None
                    if fmt == "q8_0":
                        s = scale if key == "" else small_scale
                        sc, nbytes = ptr(s.data_ptr()), nbytes + s.numel() * 2
                    sizes = (c_int(1), c_int(rows), c_int(K))
                    call = (ptr(x.data_ptr()), ptr(w.data_ptr()), ptr(y.data_ptr()), sc, None, *sizes)
                    read = (ptr(w.data_ptr()), ctypes.c_size_t(wbytes // 128 * 128))
                    rates["read" + key].append(wbytes / per_call(probe.read_bytes, read, min_s, min_calls))
                    rates["gemv" + key].append(nbytes / per_call(kernel, call, min_s, min_calls))
            med = {k: statistics.median(v) / 1e9 for k, v in rates.items()}
            share = statistics.median(a / b for a, b in zip(rates["gemv"], rates["read"]))
            print(
                f"{fmt:8s} DRAM: read {med['read']:5.1f} GB/s, gemv {med['gemv']:5.1f} GB/s ({share:.0%} of the read); "
                f"L2: read {med['read L2']:5.1f}, gemv {med['gemv L2']:5.1f} GB/s ({med['gemv L2'] / size:.1f} G "
                "weights/s)",
                flush=True,
            )
            del big
        if args.decode:
            decode_roofline(probe, args.rounds)


def decode_roofline(probe: ctypes.CDLL, rounds: int, tokens: int = 64) -> None:
    import hybridcache as hc
    from experiments.benchmark.roofline import weight_read_bytes
    from hybridcache.checkpoints.real import real_checkpoint

    buf = torch.ones(1 << 28)  # 1 GiB, [N]
    collapse([buf])
    read = (ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.numel() * 4))
    prompt = torch.randint(10, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    path = real_checkpoint("gemma3_270m")
    for weights in (None, "bfloat16", "int8", "q8_0"):
        model = hc.from_pretrained(path, weights=weights)
        nbytes = weight_read_bytes(model)["weights"]
        steps, reads = [], []
        with torch.no_grad():
            hc.generate(model, prompt, max_new_tokens=8, output_logits=False)
            for _ in range(rounds):
                reads.append(buf.numel() * 4 / per_call(probe.read_bytes, read, 0.0, 1))
                start = time.thread_time()
                hc.generate(model, prompt, max_new_tokens=tokens, output_logits=False)
                steps.append((time.thread_time() - start) / tokens)
        step, rate = statistics.median(steps), statistics.median(reads)
        print(
            f"decode {weights or 'float32':8s} {step * 1e3:6.2f} ms/token, {nbytes / 1e6:.1f} MB of weights a step: "
            f"{nbytes / step / 1e9:5.1f} GB/s; read {rate / 1e9:5.1f} GB/s: {nbytes / step / rate:.0%} of the roofline",
            flush=True,
        )
        del model


if __name__ == "__main__":
    main()
