"""The decode roofline: bytes a decode step must read / the machine's read bandwidth, measured in the same run.

Batch-B decode is memory-bound on CPU: every step reads every weight once (the tied head's full [V, D] matrix
included) and every cache byte, and produces B tokens. So tokens/s <= B * bandwidth / (weights + cache bytes).
The bandwidth is a streaming *read-only* reduction over a buffer far larger than the CPU caches, on 2 MiB pages
where the system allows, like the weights (a copy benchmark counts both directions and is the wrong yardstick for
a read-dominated workload). A shared host's bandwidth drifts by 10% and more within minutes, so the benchmark takes
it between its timing rounds (`BandwidthProbe`), under the conditions the decode timings saw, not once before or
after them.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from hybridcache.ops.huge_pages import collapse


class BandwidthProbe:
    """The read bandwidth, sampled when asked: `sample(key)` times one pass over the buffer (allocated and warmed
    once) and files the rate under `key` (the benchmark: the batch size whose timing round just ended)."""

    def __init__(self, nbytes: int = 1 << 30) -> None:
        if nbytes < 4:
            raise ValueError(f"the bandwidth probe needs at least 4 bytes, got {nbytes}")
        self.nbytes = nbytes // 4 * 4
        self._buf = torch.ones(nbytes // 4, dtype=torch.float32)  # [N]: far beyond any L3: every pass is from DRAM
        collapse([self._buf])  # on 2 MiB pages where the system allows, as from_pretrained puts the weights
        self._buf.sum()
        self.samples: dict[object, list[float]] = {}

    def sample(self, key: object = None) -> float:
        start = time.perf_counter()
        self._buf.sum()
        rate = self.nbytes / (time.perf_counter() - start)
        self.samples.setdefault(key, []).append(rate)
        return rate

    def round(self, key: object, passes: int) -> None:
        """`passes` samples under `key` after one untimed pass: right after other work the first pass measured up
        to ~15% low (another thread pool's workers still spinning, the buffer's pages out of the TLB)."""
        self._buf.sum()
        for _ in range(passes):
            self.sample(key)

    def median(self, key: object = None) -> float | None:
        """The median rate sampled under `key` (None: every sample); None before any sample."""
        got = self.samples.get(key, []) if key is not None else [r for rs in self.samples.values() for r in rs]
        return statistics.median(got) if got else None


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a `sum` over a `nbytes` float32 buffer (median of `repeats`, after one warm-up pass)."""
    probe = BandwidthProbe(nbytes)
    for _ in range(repeats):
        probe.sample()
    return probe.median()


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
