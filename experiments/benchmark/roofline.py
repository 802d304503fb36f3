"""The decode roofline: bytes a decode step must read / the machine's read bandwidth, measured in the same run.

Batch-B decode is memory-bound on CPU: every step reads every weight once (the tied head's full [V, D] matrix
included) and every cache byte, and produces B tokens. So tokens/s <= B * bandwidth / (weights + cache bytes).
The bandwidth is a streaming *read-only* reduction over a buffer far larger than the CPU caches, on 2 MiB pages
where the system allows, like the weights (a copy benchmark counts both directions and is the wrong yardstick for
a read-dominated workload). A shared host's bandwidth drifts by 10% and more within minutes, so the benchmark takes
it between its timing rounds (`BandwidthProbe`, in a worker process holding the buffer), under the conditions the
decode timings saw, not once before or after them.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


class BandwidthProbe:
    """The read bandwidth, sampled when asked, in a worker process of its own
    (experiments/benchmark/bandwidth_worker.py) that
    holds the buffer: the benchmark's peak RSS does not count it. `round(key, passes)` has the worker read the
    buffer once untimed, then `passes` times, and files the rates under `key` (the benchmark: the batch size whose
    timing round just ended). Close it (or use it as a context manager) to end the worker."""

    def __init__(self, nbytes: int = 1 << 30, threads: int | None = None) -> None:
        if nbytes < 4:
            raise ValueError(f"the bandwidth probe needs at least 4 bytes, got {nbytes}")
        self.nbytes = nbytes // 4 * 4
        self.samples: dict[object, list[float]] = {}
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # idle between rounds: its threads must not spin then
        cmd = [
            sys.executable,
            "-m",
            "experiments.benchmark.bandwidth_worker",
            str(self.nbytes),
            str(threads or torch.get_num_threads()),
        ]
        self._stderr = tempfile.TemporaryFile(mode="w+")  # (a file, not a pipe: a chatty worker never blocks on it)
        self._worker = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True
        )
        self._expect("ready")

    def round(self, key: object, passes: int) -> list[float]:
        """`passes` (>= 1) timed reads of the buffer after one untimed one, filed under `key`; their rates."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"a probe round needs at least one timed pass, got {passes!r}")
        if self._worker is None:
            raise RuntimeError("the bandwidth probe was closed")
        try:
            self._worker.stdin.write(f"{passes}\n")
            self._worker.stdin.flush()
        except BrokenPipeError:  # the worker died: _expect reads its end and says why
            pass
        rates = [float(r) for r in self._expect(None).split()]
        if len(rates) != passes or not all(math.isfinite(r) and r > 0 for r in rates):
            self.close()
            raise RuntimeError(f"the bandwidth probe's worker answered {rates!r} for {passes} passes")
        self.samples.setdefault(key, []).extend(rates)
        return rates

    def median(self, key: object = None) -> float | None:
        """The median rate sampled under `key` (None: every sample); None before any sample."""
        got = self.samples.get(key, []) if key is not None else [r for rs in self.samples.values() for r in rs]
        return statistics.median(got) if got else None

    def close(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stdin.close()  # (its loop ends at the end of stdin)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
            worker.stdout.close()
            self._stderr.close()

    def __enter__(self) -> BandwidthProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _expect(self, first: str | None) -> str:
        """The worker's next line (which must start with `first`, when given); its stderr in a RuntimeError if it
        ended (or said something else) instead."""
        line = self._worker.stdout.readline()
        if line and (first is None or line.startswith(first)):
            return line
        worker, self._worker = self._worker, None
        with contextlib.suppress(BrokenPipeError):
            worker.stdin.close()  # (a worker still running ends at the end of stdin)
        worker.wait()
        worker.stdout.close()
        self._stderr.seek(0)
        err = self._stderr.read()
        self._stderr.close()
        raise RuntimeError(
            f"the bandwidth probe's worker ({self.nbytes >> 20} MiB) ended with code {worker.returncode}: "
            f"{(err or line).strip().splitlines()[-1][-2000:] if (err or line).strip() else 'no output'}"
        )


def weight_read_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of weights one decode step reads: every parameter once (shared ones once; packed projections in their
    packed bytes, with their scales), except input embeddings that no output projection shares (a step reads only B
    of their rows). MoE experts all count (an upper bound)."""
    params = {p.data_ptr(): p for p in model.parameters()}
    # packed (int8) projections read a per-row scale too
    params.update({s.data_ptr(): s for m in model.modules() if (s := m._buffers.get("scale")) is not None})
    linear = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Linear)}
    skipped = {
        m.weight.data_ptr()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and m.weight.data_ptr() not in linear
    }
    total = sum(p.numel() * p.element_size() for k, p in params.items() if k not in skipped)
    embed = sum(params[k].numel() * params[k].element_size() for k in skipped)
    return {"weights": total, "untied_embeddings_not_read": embed}


def roofline_row(
    system: str, batch: int, decode_tok_s: float, weights: int, cache_bytes: int, bandwidth: float
) -> dict:
    """Bytes per generated token, the roofline tokens/s for this batch and the fraction reached."""
    per_step = weights + cache_bytes
    limit = batch * bandwidth / per_step
    return {
        "system": system,
        "batch": batch,
        "bytes_per_token": per_step / batch,
        "roofline_tok_s": limit,
        "decode_tok_s": decode_tok_s,
        "fraction": decode_tok_s / limit,
    }
