"""A/B of two builds of the C kernels in one process: the batch-1 float32 decode's matrices and the q8_0 prefill GEMM.

Build A is the kernel sources at a git revision (`--base`, default main), build B the working tree's; each is compiled
as the library is (-O3 -march=native -fopenmp) together with a small driver that runs a workload from C, and both are
loaded side by side. Rounds alternate A B B A, one thread, timed by the thread's CPU time and by the wall clock; the
read roofline (a streaming read of 1 GiB, gemv_roofline.py's probe) is measured between rounds. Workloads, with Gemma 3
270M's shapes (hidden 640, q/k/v 1536, MLP 2048, vocab 262144):

- `decode`: the float32 weights of a batch-1 decode step: 18 layers x (qkv, o, gate/up, down) then the head, each a
  hc_linear_f32 call at M = 1 (the order of a step; 1072 MB on 2 MiB pages), as GB/s of weights and share of the read;
- `prefill`: hc_linear_q8_0 at M = 128 over one layer's four matrices (random q8_0 weights): G multiply-adds/s.

Outputs of A and B are compared (the largest difference; 0 when the sums keep their order).

    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/benchmark/standalone/kernel_ab.py [--base main] [--rounds 4]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

from experiments.benchmark.standalone.gemv_roofline import compile_probe
from hybridcache.accel.huge_pages import collapse
from hybridcache.accel.native.build import BASE_FLAGS, LIBS, OPENMP_FLAGS, SOURCE_DIR

CSRC = "hybridcache/accel/native/csrc"
DRIVER = r"""
#include "cpu_decode.c"
/* the decode step's matrices in order: y_i = w_i x (x: one row, the largest K), hint: the next matrix */
void ab_decode(const float *const *w, const int *n, const int *k, int count, const float *x, float *y) {
  for (int i = 0; i < count; i++) hc_linear_f32(x, w[i], y, NULL, NULL, 1, n[i], k[i]);
}
void ab_prefill(const int8_t *const *w, const uint16_t *const *s, const int *n, const int *k, int count,
                const float *x, int M, float *const *y) {
  for (int i = 0; i < count; i++) hc_linear_q8_0(x, w[i], y[i], s[i], NULL, M, n[i], k[i]);
}
"""
D, Q, MLP, V, LAYERS = 640, 1024, 2048, 262144, 18
LAYER = ((3 * 512, D), (D, Q), (2 * MLP, D), (D, MLP))  # (N, K): qkv (4 + 2 heads of 256), o, gate/up, down


def sources(rev: str | None, into: Path) -> Path:
    """The kernel sources at git revision rev (None: the working tree), copied into `into`."""
    into.mkdir()
    if rev is None:
        for f in SOURCE_DIR.iterdir():
            if f.suffix in (".c", ".h"):
                (into / f.name).write_bytes(f.read_bytes())
    else:
        tar = subprocess.run(["git", "archive", rev, CSRC], check=True, capture_output=True).stdout
        with tarfile.open(fileobj=BytesIO(tar)) as t:
            for m in t.getmembers():
                if m.isfile():
                    (into / Path(m.name).name).write_bytes(t.extractfile(m).read())
    (into / "ab_driver.c").write_text(DRIVER)
    return into


def build(src: Path, extra: list[str]) -> ctypes.CDLL:
    out = src / "ab.so"
    cmd = ["cc", *BASE_FLAGS, *OPENMP_FLAGS, *extra, str(src / "ab_driver.c"), "-o", str(out), *LIBS]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(out))


def ptrs(ts: list[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(ts))(*(t.data_ptr() for t in ts))


def ints(vals: list[int]) -> ctypes.Array:
    return (ctypes.c_int * len(vals))(*vals)


def timed(fn, args: tuple, calls: int) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) per call, after one untimed call."""
    fn(*args)
    c0, w0 = time.thread_time(), time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.thread_time() - c0) / calls, (time.perf_counter() - w0) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="main", help="git revision of build A")
    parser.add_argument("--flags-a", default="", help="extra compiler flags for A (e.g. -DPF_ROWS=4)")
    parser.add_argument("--flags-b", default="", help="extra compiler flags for B")
    parser.add_argument("--base-is-tree", action="store_true", help="A from the working tree too (flags-only A/B)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--what", default="decode,prefill")
    parser.add_argument("--calls", type=int, default=6, help="decode steps / prefill GEMMs per timing")
    args = parser.parse_args()
    if os.environ.get("OMP_NUM_THREADS") != "1":
        raise SystemExit("run with OMP_NUM_THREADS=1 (one thread; the builds' OpenMP reads it at load)")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        a = build(sources(None if args.base_is_tree else args.base, tmp / "a"), args.flags_a.split())
        b = build(sources(None, tmp / "b"), args.flags_b.split())
        probe = compile_probe(tmp)
        buf = torch.ones(1 << 28)  # 1 GiB
        collapse([buf])
        read = (ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.numel() * 4))
        what = args.what.split(",")
        work = {}
        if "decode" in what:
            shapes = [s for _ in range(LAYERS) for s in LAYER] + [(V, D)]
            ws = [torch.randn(n, k, generator=g) * 0.05 for n, k in shapes]
            collapse(ws)
            x, y = torch.randn(max(k for _, k in shapes), generator=g), torch.empty(V)
            nbytes = sum(w.numel() * 4 for w in ws)
            call = (ptrs(ws), ints([n for n, _ in shapes]), ints([k for _, k in shapes]), len(ws))
            work["decode"] = (
                "ab_decode",
                (*call, ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr())),
                nbytes,
                "GB/s of weights",
                y,
                ws,
            )
        if "prefill" in what:
            M = 128
            ws = [torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) for n, k in LAYER]
            ss = [(torch.rand(n, k // 32, generator=g) * 0.01).half() for n, k in LAYER]
            x = torch.randn(M, max(k for _, k in LAYER), generator=g)
            ys = [torch.empty(M, n) for n, _ in LAYER]
            # x's rows are K apart: every matrix reads its first K columns as rows of its own K (contiguous)
            xs = [x[:, :k].contiguous() for _, k in LAYER]
            macs = sum(M * n * k for n, k in LAYER)

            def prefill(lib, *_):
                for j, (n, k) in enumerate(LAYER):
                    lib.ab_prefill(
                        ptrs([ws[j]]),
                        ptrs([ss[j]]),
                        ints([n]),
                        ints([k]),
                        1,
                        ctypes.c_void_p(xs[j].data_ptr()),
                        M,
                        ptrs([ys[j]]),
                    )

            work["prefill"] = (prefill, (), macs, "G multiply-adds/s", ys, None)
        for name, (fn, call, amount, unit, out, _) in work.items():
            results = {"A": [], "B": []}
            outs = {}
            reads = []
            for r in range(args.rounds):
                for tag in "AB" if r % 2 == 0 else "BA":
                    lib = a if tag == "A" else b
                    f = (lambda *c, lib=lib, fn=fn: fn(lib, *c)) if callable(fn) else getattr(lib, fn)
                    results[tag].append(timed(f, call, args.calls))
                    outs[tag] = [o.clone() for o in (out if isinstance(out, list) else [out])]
                reads.append(buf.numel() * 4 / timed(probe.read_bytes, read, 1)[0])
            diff = max((oa - ob).abs().max().item() for oa, ob in zip(outs["A"], outs["B"]))
            rate = statistics.median(reads)
            load = os.getloadavg()[0]
            for tag in "AB":
                cpu = statistics.median(t for t, _ in results[tag])
                wall = statistics.median(w for _, w in results[tag])
                share = f", {amount / cpu / rate:.0%} of the read" if name == "decode" else ""
                print(
                    f"{name} {tag}: {cpu * 1e3:7.2f} ms CPU ({amount / cpu / 1e9:5.1f} {unit}{share}), "
                    f"{wall * 1e3:7.2f} ms wall",
                    flush=True,
                )
            ratio = statistics.median(ta / tb for (ta, _), (tb, _) in zip(results["A"], results["B"]))
            print(
                f"{name}: B/A speed {ratio:.3f}x (median of the rounds' CPU-time ratios), read {rate / 1e9:.1f} "
                f"GB/s, largest |A - B| {diff:.3g}, load {load:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
