"""`mlstm`: the state of an mLSTM layer (xLSTM), a new recurrent cache type written as a plugin.

Per head a matrix memory C [Dqk, Dv], a normalizer n [Dqk] and a max-stabilizer m (a log-scale, 0 at the start as
in HF) that also floors the output's denominator, so it is part of the state, not just a numerical device. All three
are float32 unless `state_dtype` says otherwise. Staging, rollback checkpoints, codecs, offload, snapshots and saving
come from the in-tree RecurrentCacheLayer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.base import check_float_dtype, tunable
from hybridcache.cache.recurrent import RecurrentCacheLayer, RecurrentSpec
from hybridcache.cache.registry import register_cache_layer


@dataclass(frozen=True, kw_only=True)
class MLSTMSpec(RecurrentSpec):
    """mLSTM: matrix memory C [H, Dqk, Dv], normalizer n [H, Dqk], max-stabilizer m [H]."""

    num_heads: int
    qk_head_dim: int
    v_head_dim: int
    state_dtype: torch.dtype = tunable(torch.float32)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("num_heads", "qk_head_dim", "v_head_dim")
        check_float_dtype(type(self).__name__, "state_dtype", self.state_dtype)

    def state_shapes(self):
        h, dk, sd = self.num_heads, self.qk_head_dim, self.state_dtype
        return {"C": ((h, dk, self.v_head_dim), sd), "n": ((h, dk), sd), "m": ((h,), sd)}


@register_cache_layer("mlstm")
class MLSTMStateLayer(RecurrentCacheLayer):
    """An mLSTM layer's matrix memory, normalizer and stabilizer."""

    spec_cls = MLSTMSpec
    example_native = {"num_heads": 2, "qk_head_dim": 3, "v_head_dim": 2}
