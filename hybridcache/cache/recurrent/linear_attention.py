"""`linear_attention`: the state of a decayed linear-attention layer without a short convolution (MiniMax's
lightning attention: S <- exp(-slope) * S + k^T v per token, output q S).

Written as a plugin would be: one spec and one registered class. The layer keeps one state, recurrent [H, Dk, Dv]
(the running sum of k^T v outer products per head), in `state_dtype` (float32 unless set; HF's MiniMax keeps it in
the model's dtype, and the bridge asks for that). It has no conv state, so `quantize_conv` changes nothing here. Its
size does not grow with the sequence. It takes every recurrent storage option (layers.py): `rollback`, a
`state_codec` (`state_group: head` gives one scale per head, `channel` one per (head, key dim) row of Dv values) and
`offload`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.core.base import check_float_dtype, tunable
from hybridcache.cache.core.registry import register_cache_layer
from hybridcache.cache.recurrent.layers import RecurrentCacheLayer, RecurrentSpec


@dataclass(frozen=True, kw_only=True)
class LinearAttentionSpec(RecurrentSpec):
    """Linear attention: one state [H, Dk, Dv] and no conv state."""

    num_heads: int
    key_dim: int
    value_dim: int
    state_dtype: torch.dtype = tunable(torch.float32)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("num_heads", "key_dim", "value_dim")
        check_float_dtype(type(self).__name__, "state_dtype", self.state_dtype)

    def state_shapes(self):
        return {"recurrent": ((self.num_heads, self.key_dim, self.value_dim), self.state_dtype)}


@register_cache_layer("linear_attention")
class LinearAttentionStateLayer(RecurrentCacheLayer):
    """Linear-attention state only (MiniMax's lightning attention)."""

    spec_cls = LinearAttentionSpec
    example_native = {"num_heads": 2, "key_dim": 3, "value_dim": 2}
