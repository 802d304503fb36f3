"""The read-bandwidth probe's own process (experiments/benchmark/roofline.py `BandwidthProbe`): it holds the probe's
buffer, so
the benchmark's peak RSS stays the benchmark's.

`python -m experiments.benchmark.bandwidth_worker NBYTES THREADS`: allocates NBYTES of float32 (on 2 MiB pages where
the system
allows, as from_pretrained puts the weights), reads it once, prints `ready`; then for each line `N` on stdin reads it
once untimed (right after other work the first pass measured up to ~15% low) and N times timed, and prints the N
rates (bytes/s) on one line. Exits at the end of stdin.
"""

from __future__ import annotations

import sys
import time


def main(nbytes: int, threads: int) -> None:
    import torch

    from hybridcache.accel.huge_pages import collapse

    torch.set_num_threads(threads)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # [N]: far beyond any L3: every pass streams from DRAM
    collapse([buf])
    buf.sum()
    print("ready", flush=True)
    for line in sys.stdin:
        passes = int(line)
        buf.sum()
        rates = []
        for _ in range(passes):
            start = time.perf_counter()
            buf.sum()
            rates.append(buf.numel() * 4 / (time.perf_counter() - start))
        print(" ".join(repr(r) for r in rates), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
