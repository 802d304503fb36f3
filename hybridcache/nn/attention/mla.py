"""Multi-head latent attention (MLA, DeepSeek-V2/V3; Kimi Linear's full attention), HF parameter names.

Queries come from q_proj, or through a low-rank q_a_proj -> q_a_layernorm -> q_b_proj. Keys and values come from
one compressed latent: kv_a_proj_with_mqa(h) = [c (kv_lora_rank) | k_rot (qk_rope_head_dim, shared by the heads)],
kv_b_proj(kv_a_layernorm(c)) = per head [k_nope | v]; a head's key is [k_nope | k_rot]. The optional rotary turns
the last qk_rope_head_dim dims of q and k_rot (Kimi Linear has none: NoPE; Bailing-hybrid's is interleaved, and an
optional per-head sigmoid gate g_proj scales each head's output).

The cache is a plain `full` attention cache of H heads holding the decompressed keys and values (HF caches the
latent and decompresses every step: the same numbers, as kv_b_proj acts on each token alone). Keys are
qk_nope + qk_rope wide and values v_head_dim: both are zero-padded to the wider of the two, which leaves the scores
and the kept value dims unchanged, and o_proj drops the padding. Everything else (masks, the decode kernel,
eviction hooks) is AttentionMixer's.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.nn.attention.mixer import AttentionMixer
from hybridcache.nn.attention.rotary import RotaryEmbedding
from hybridcache.nn.core.common import StepInput
from hybridcache.nn.core.norms import RMSNorm


class _Unpad(nn.Linear):
    """o_proj reading the first `keep` of every `width` dims of each head (the padded attention output)."""

    def __init__(self, heads: int, keep: int, width: int, out: int, bias: bool) -> None:
        super().__init__(heads * keep, out, bias=bias)
        self.heads, self.keep, self.width = heads, keep, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H * width] -> [B, T, out]
        if self.keep != self.width:
            x = x.unflatten(-1, (self.heads, self.width))[..., : self.keep].flatten(-2)
        return super().forward(x)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else nn.functional.pad(x, (0, width - x.shape[-1]))


class MLAMixer(AttentionMixer):
    """forward(h [B, T, D], layer, step) -> [B, T, D]; the cache layer has H kv heads of the padded width."""

    # low-rank q / kv projections with a split rotary part: not the fused kernels' plain q / k / v
    plain_projection = False

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        eps: float = 1e-6,
        bias: bool = False,
        rotary: RotaryEmbedding | None = None,
        head_gate: bool = False,
    ) -> None:
        qk = qk_nope_head_dim + qk_rope_head_dim
        width = max(qk, v_head_dim)  # what the cache holds per head
        super().__init__(hidden, num_heads, num_heads, width, scale=qk**-0.5, rotary=rotary)
        del self.q_proj, self.k_proj, self.v_proj, self.qkv  # MLA's own projections below
        self.nope, self.rope, self.dv, self.rank = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = _Unpad(num_heads, v_head_dim, width, hidden, bias)
        if head_gate:  # Bailing-hybrid: attention output times sigmoid(g_proj(h)), one gate per head
            self.g_proj = nn.Linear(hidden, num_heads, bias=False)

    def projection_groups(self) -> list:
        return []

    def _project(self, h: torch.Tensor, step: StepInput, extra, prerope: bool = False) -> tuple:
        """q [B, H, T, W], k and v [B, H, T, W] (W the padded width), the per-head output gate [B, T, H * W] or
        None, q before rotary (prerope)."""
        if extra is not None:
            raise ValueError("MLA attention takes no per-call projection terms")
        b, t, _ = h.shape
        q = self.q_proj(h) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q = q.view(b, t, self.num_heads, -1).transpose(1, 2)  # [B, H, T, nope + rope]
        c, k_rot = self.kv_a_proj_with_mqa(h).split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, t, self.num_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)  # [B, H, T, nope], [B, H, T, Dv]
        k_rot = k_rot[:, None]  # [B, 1, T, rope]: one rotated key part shared by the heads
        q_pre = q if prerope else None
        if self.rotary is not None:
            q_rot, k_rot = self.rotary(q[..., self.nope :], k_rot, step)
            q = torch.cat([q[..., : self.nope], q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.num_heads, -1, -1)], dim=-1)
        w = self.head_dim
        gate = self.g_proj(h).repeat_interleave(w, dim=-1) if hasattr(self, "g_proj") else None
        return _pad(q, w), _pad(k, w), _pad(v, w), gate, None if q_pre is None else _pad(q_pre, w)
