"""`pyramidkv`: kvpress PyramidKVPress (Cai et al. 2024): SnapKV's scores, more tokens for lower layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.core.base import check_positive_int, tunable
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.methods.presses.snapkv import SnapKV, SnapKVSpec
from hybridcache.cache.methods.scored_eviction import register_press


@dataclass(frozen=True, kw_only=True)
class PyramidKVSpec(SnapKVSpec):
    beta: int = tunable(20)
    layer_index: int = 0  # from the plan: this layer's decoder index and the stack's depth
    num_layers: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("PyramidKVSpec", "beta", self.beta)
        check_positive_int("PyramidKVSpec", "num_layers", self.num_layers)
        if not 0 <= self.layer_index < self.num_layers:
            raise CacheError(f"PyramidKVSpec: layer_index {self.layer_index} outside [0, {self.num_layers})")

    def layer_budget(self, q_len: int) -> int:
        """kvpress's get_layer_budget (after KVCache-Factory): a linear pyramid between max_num (layer 0) and
        min_num (the last layer) whose mean is the uniform budget; the uniform budget when no pyramid fits."""
        kept = q_len * (1 - self.compression_ratio) if self.budget is None else min(q_len, self.budget)
        w = self.window_size
        capacity = w + kept
        min_num = (capacity - w) / self.beta
        max_num = (capacity - w) * 2 - min_num
        if max_num >= q_len - w:
            max_num = q_len - w
            min_num = (capacity - w) * 2 - max_num
        if not q_len >= max_num >= min_num >= w:
            return max(1, round(kept))
        steps = (max_num - min_num) / (self.num_layers - 1) if self.num_layers > 1 else 0.0
        return round(max_num - self.layer_index * steps)


class PyramidKV(SnapKV):
    """kvpress PyramidKVPress: SnapKV's scores under this layer's budget of the pyramid."""

    def targets(self, candidates):
        budgets = [[self.spec.layer_budget(int(c)) if c else 0 for c in row] for row in candidates.tolist()]
        return torch.tensor(budgets, dtype=torch.long, device=candidates.device).clamp(max=candidates)


PyramidKVLayer = register_press(
    "pyramidkv", PyramidKVSpec, PyramidKV, {"compression_ratio": 0.4, "window_size": 3, "kernel_size": 3}
)
