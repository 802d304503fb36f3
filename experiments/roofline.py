"""The decode roofline: bytes a decode step must read / the machine's read bandwidth, measured in the same run.

Batch-B decode is memory-bound on CPU: every step reads every weight once (the tied head's full [V, D] matrix
included) and every cache byte, and produces B tokens. So tokens/s <= B * bandwidth / (weights + cache bytes).
The bandwidth is a streaming *read-only* reduction over a buffer far larger than the CPU caches, on 2 MiB pages
where the system allows, like the weights (a copy benchmark counts both directions and is the wrong yardstick for
a read-dominated workload).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from hybridcache.ops.huge_pages import collapse


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a `sum` over a `nbytes` float32 buffer (median of `repeats`, after one warm-up pass)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)  # [N]: far beyond any L3, so every pass streams from DRAM
    collapse([buf])  # on 2 MiB pages where the system allows, as from_pretrained puts the weights
    buf.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return nbytes / sorted(times)[len(times) // 2]


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
