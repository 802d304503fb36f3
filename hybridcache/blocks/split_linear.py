"""A faster CPU path for the biggest projection of a decode step (usually the tied vocabulary head).

A decode step multiplies a few rows by a [V, D] matrix (262k x 640 floats = 671 MB for Gemma 3 270M). On CPU,
`F.linear` with so few rows becomes a BLAS gemv, which runs on one thread here and reaches about half of the
memory's read bandwidth. Viewing the weight as S row blocks and multiplying them as one batched matmul
[S, V/S, D] @ [S, D, M] lets the BLAS spread the blocks over the threads: measured on the 2-core benchmark machine,
the 262k-row head goes from 75 ms to 20 ms at batch 1 and from 130 ms to 60 ms at batch 8 (4 blocks; a streaming
read of the same 671 MB takes 22 ms).
Same products and sums per output; only the BLAS kernel (and so the last bits of rounding) differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_BYTES = 64 << 20  # smaller weights: gemv is already fast (they fit better in the caches) and bmm overhead wins
MAX_ROWS = 64  # more rows than this: a real gemm, threaded anyway
SPLITS = (4, 2, 8)  # measured: 4 blocks best for the 262k x 640 head at batch 1 and 8 on 2 cores


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int) -> torch.Tensor:
    """x [..., D] @ weight[V, D].T (+ bias) as `splits` row blocks in one bmm; [..., V]."""
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d).T.unsqueeze(0).expand(splits, d, -1)  # [S, D, M]
    out = torch.bmm(weight.view(splits, -1, d), rows)  # [S, V/S, M]
    out = out.permute(2, 0, 1).reshape(*lead, weight.shape[0])  # [..., V]
    return out if bias is None else out + bias


class SplitRowsLinear(nn.Linear):
    """nn.Linear that takes the batched-blocks path for a big weight, few rows, on CPU; F.linear otherwise."""

    splits: int = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.numel() // x.shape[-1] <= MAX_ROWS and not torch.compiler.is_compiling():
            return split_linear(x, self.weight, self.bias, self.splits)
        return F.linear(x, self.weight, self.bias)


def use_split_rows(model: nn.Module, min_bytes: int = MIN_BYTES) -> list[str]:
    """Switch every nn.Linear whose weight has at least `min_bytes` (and a row count some split divides) to the
    batched-blocks path, in place (same parameters, shared ones stay shared). Returns the module names."""
    switched = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        if w.numel() * w.element_size() < min_bytes:
            continue
        splits = next((s for s in SPLITS if w.shape[0] % s == 0), None)
        if splits is None:
            continue
        module.__class__ = SplitRowsLinear
        module.splits = splits
        switched.append(name)
    return switched
