"""Attention with cross-layer KV sharing (Gemma 4; vLLM's `kv_sharing_target_layer_name`).

A *writer* projects its own keys and values and stores them in its cache layer, like `AttentionMixer`. A *reader*
has no k/v projections and no cache entry: it attends to the view the last writer with the same `share` key (Gemma 4:
the layer type) returned for this very block, handed over in the block's memo (HF's `shared_kv_states`), so the
cache holds each shared K/V once. Rollback, save and
load therefore need nothing extra: the reader has no state, and the writer's view of the block is rebuilt from its
own cache layer every block.

Per head: q and k get RMS norms, v a weightless RMS norm; the softmax scale is 1 (the norms set the scale).
`k_eq_v` (Gemma 4's `attention_k_eq_v` on global layers): no v_proj, the values are the raw key projection.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from hybridcache.cache import AttentionCacheLayer
from hybridcache.cache.methods.scored_eviction import QueryInputs
from hybridcache.nn.attention.rotary import RotaryEmbedding, rope_frequencies
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.norms import RMSNorm, WeightlessRMSNorm
from hybridcache.ops import masked_attention


def layer_rotary(hf_config: dict, params: dict, head_dim: int) -> RotaryEmbedding:
    """The rotary of one `rope_parameters` entry over head_dim channels. HF's "proportional" type: head_dim / 2
    angles, the first partial_rotary_factor of them rotated with exponents over the whole head_dim, the others 0
    (those channels pass unrotated); any other type by `rope_frequencies`."""
    if params.get("rope_type") != "proportional":
        return RotaryEmbedding(*rope_frequencies(hf_config, params, head_dim))
    rotated = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    inv_freq = 1.0 / params["rope_theta"] ** (torch.arange(0, 2 * rotated, 2).float() / head_dim)
    return RotaryEmbedding(
        torch.cat([inv_freq, inv_freq.new_zeros(head_dim // 2 - rotated)]) / params.get("factor", 1.0)
    )


class KVSharedAttention(nn.Module):
    """q/k/v/o projections with HF's names; `reader=True` builds only q_proj, q_norm and o_proj."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rotary: RotaryEmbedding,
        eps: float,
        share: str = "",
        reader: bool = False,
        k_eq_v: bool = False,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.reader = num_heads, num_kv_heads, head_dim, reader
        self.rotary, self.share = rotary, ("kv_shared_view", share)  # the memo key readers find their view under
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps, scale_in_float32=True)
        if not reader:
            self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
            self.v_proj = None if k_eq_v else nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
            self.k_norm = RMSNorm(head_dim, eps, scale_in_float32=True)
            self.v_norm = WeightlessRMSNorm(eps)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=bias)

    def forward(self, h: torch.Tensor, kv: AttentionCacheLayer | None, step: StepInput) -> torch.Tensor:
        """Output [B, T, D]. `kv`: a writer's cache layer (None for a reader)."""
        b, t, _ = h.shape
        q = q_pre = self.q_norm(self.q_proj(h).view(b, t, self.num_heads, self.head_dim).transpose(1, 2))  # [B,Hq,T,D]
        if self.reader:
            view = step.memo[self.share]
            q = self.rotary(q, q[:, :1], step)[0]  # only q: the keys were rotated by the writer
        else:
            kp = self.k_proj(h).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
            vp = kp if self.v_proj is None else self.v_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
            q, k = self.rotary(q, self.k_norm(kp), step)
            v, dtype = self.v_norm(vp), kv.spec.dtype
            view = step.memo[self.share] = kv.update(k.to(dtype), v.to(dtype))
        keys, values = view.keys.to(q.dtype), view.values.to(q.dtype)
        wants_queries = not self.reader and getattr(kv, "wants_queries", False)  # ExpectedAttention
        if not self.reader and (kv.wants_attention_weights or wants_queries):  # score-based eviction: the writer's
            out, weights = masked_attention(q, keys, values, view.mask, 1.0, return_weights=True)
            rotation = partial(self.rotary.mean_rotation, head_dim=self.head_dim)
            kv.observe_attention(weights, QueryInputs(q_pre, rotation, 1.0) if wants_queries else None)
        else:
            out = masked_attention(q, keys, values, view.mask, 1.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
