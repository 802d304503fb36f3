"""`gated_delta`: the state of a gated delta-rule linear-attention layer (Gated DeltaNet, Qwen3-Next).

Written as a plugin would be: one spec and one registered class. The layer keeps the short causal convolution's
last K-1 inputs over the concatenated q, k, v channels, conv [2 * Hk * Dk + Hv * Dv, K-1], and the delta-rule
state, recurrent [Hv, Dk, Dv] (float32 unless `state_dtype` says otherwise). Its size does not grow with the
sequence. It takes every recurrent storage option (recurrent.py): `rollback`, a `state_codec` (`state_group:
head` gives one scale per value head, `channel` one per (head, key dim) row of Dv values) and `offload`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.core.base import check_float_dtype, tunable
from hybridcache.cache.core.errors import CacheError
from hybridcache.cache.core.registry import register_cache_layer
from hybridcache.cache.recurrent.layers import RecurrentCacheLayer, RecurrentSpec


@dataclass(frozen=True, kw_only=True)
class GatedDeltaSpec(RecurrentSpec):
    """Gated DeltaNet: conv state over q, k, v [2*Hk*Dk + Hv*Dv, K-1] and delta-rule state [Hv, Dk, Dv]."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    state_dtype: torch.dtype = tunable(torch.float32)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel")
        if self.num_v_heads % self.num_k_heads:
            raise CacheError(
                f"GatedDeltaSpec: num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads "
                f"({self.num_k_heads})"
            )
        check_float_dtype(type(self).__name__, "state_dtype", self.state_dtype)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def state_shapes(self):
        return {
            "conv": ((self.conv_dim, self.conv_kernel - 1), self.dtype),
            "recurrent": ((self.num_v_heads, self.head_k_dim, self.head_v_dim), self.state_dtype),
        }


@register_cache_layer("gated_delta")
class GatedDeltaStateLayer(RecurrentCacheLayer):
    """Gated DeltaNet conv + delta-rule state."""

    spec_cls = GatedDeltaSpec
    example_native = {"num_k_heads": 1, "num_v_heads": 2, "head_k_dim": 3, "head_v_dim": 2, "conv_kernel": 4}
