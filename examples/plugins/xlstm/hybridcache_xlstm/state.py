"""`mlstm`: the state of an mLSTM layer (xLSTM), a new recurrent cache type written as a plugin.

Per head a matrix memory C [Dqk, Dv], a normalizer n [Dqk] and a max-stabilizer m (a log-scale, 0 at the start as
in HF) that also floors the output's denominator, so it is part of the state, not just a numerical device. All three
are float32 unless `state_dtype` says otherwise; `mlstm_step` is their per-token update. Staging, rollback
rollback, codecs, offload, snapshots and saving come from the in-tree RecurrentCacheLayer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridcache.cache.core.base import check_float_dtype, tunable
from hybridcache.cache.core.registry import register_cache_layer
from hybridcache.cache.recurrent.layers import RecurrentCacheLayer, RecurrentSpec


def mlstm_step(c, n, m, q, k, v, i, f, eps: float = 1e-6):
    """HF's `mlstm_recurrent_step_native`: q, k [B, H, Dqk], v [B, H, Dv], gate pre-activations i, f [B, H] (i = -inf,
    f = +inf: no change), c [B, H, Dqk, Dv], n [B, H, Dqk], m [B, H] -> h [B, H, Dv], (c, n, m) after the token."""
    log_f = F.logsigmoid(f)
    m_new = torch.maximum(log_f + m, i)
    f_act, i_act = torch.exp(log_f + m - m_new), torch.exp(i - m_new)  # [B, H]
    c = f_act[..., None, None] * c + i_act[..., None, None] * (k[..., :, None] @ v[..., None, :])
    n = f_act[..., None] * n + i_act[..., None] * k
    q = q * q.shape[-1] ** -0.5
    num = (q[..., None, :] @ c).squeeze(-2)  # [B, H, Dv]
    qn = (q[..., None, :] @ n[..., None]).squeeze(-1)  # [B, H, 1]
    return num / (torch.maximum(qn.abs(), torch.exp(-m_new)[..., None]) + eps), (c, n, m_new)


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
