"""`lightning`: the state of a lightning-attention layer (MiniMax), a new recurrent cache type written as a plugin.

Lightning attention is linear attention with a fixed per-head decay: S_t = exp(-s_h) S_{t-1} + k_t^T v_t and
o_t = q_t S_t (`lightning_scan`), so a layer's history is one decayed key-value state, kv [H, D, D] (key dim x
value dim; float32 unless `state_dtype` says otherwise) whatever the length. Staging, rollback trails, state
codecs, offload, snapshots and saving come from the in-tree RecurrentCacheLayer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.core.base import check_float_dtype, tunable
from hybridcache.cache.core.registry import register_cache_layer
from hybridcache.cache.recurrent.layers import RecurrentCacheLayer, RecurrentSpec


def lightning_scan(q, k, v, g, kv, chunk: int = 64):
    """o_t = q_t S_t, S_t = exp(g_t) S_{t-1} + k_t^T v_t from S_0 = kv, in chunks: q, k, v [B, H, T, D], log-decay
    g [B, H, T] (0 at padding), kv [B, H, D, D]. Returns o [B, H, T, D] and the state after the last token."""
    outs = []
    for s in range(0, q.shape[2], chunk):
        qc, kc, vc, gc = (y[:, :, s : s + chunk] for y in (q, k, v, g))
        cum = gc.cumsum(-1)  # [B, H, C]: log of the decay from the chunk start through each token
        causal = torch.ones(gc.shape[-1], gc.shape[-1], dtype=torch.bool, device=q.device).tril()
        w = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, -torch.inf))  # [B, H, C, C]
        outs.append((qc @ kc.transpose(-1, -2) * w) @ vc + (qc * cum[..., None].exp()) @ kv)
        tail = (cum[..., -1:] - cum).exp()[..., None]  # [B, H, C, 1]: decay from each token to the chunk end
        kv = cum[..., -1, None, None].exp() * kv + (kc * tail).transpose(-1, -2) @ vc
    return torch.cat(outs, dim=2), kv


@dataclass(frozen=True, kw_only=True)
class LightningSpec(RecurrentSpec):
    """Lightning attention: decayed linear-attention state kv [H, D, D]."""

    num_heads: int
    head_dim: int
    state_dtype: torch.dtype = tunable(torch.float32)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check("num_heads", "head_dim")
        check_float_dtype(type(self).__name__, "state_dtype", self.state_dtype)

    def state_shapes(self):
        return {"kv": ((self.num_heads, self.head_dim, self.head_dim), self.state_dtype)}


@register_cache_layer("lightning")
class LightningStateLayer(RecurrentCacheLayer):
    """Lightning attention's decayed key-value state."""

    spec_cls = LightningSpec
    example_native = {"num_heads": 2, "head_dim": 3}
