"""Zamba (v1, Zyphra): multi-head Mamba (v1) layers, and at some of them ("hybrid" layers) one shared transformer
block first, fed [h | original embeddings]. The skeleton is Zamba2's (hybridcache/models/families/zamba2.py) with one
shared
block, no adapters and no rotary embedding; the Mamba mixer splits its channels into `n_mamba_heads` heads, each
with its own x_proj / dt_proj, so B and C are per head. Its cache is Mamba's (`mamba`: conv and SSM states over
all channels). HF's in_proj interleaves x and the gate channel by channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hybridcache.accel import register_accel
from hybridcache.accel.mixers.recurrent import mamba_groups_accel
from hybridcache.cache import CacheLayer, NativeLayer
from hybridcache.models.core.config_pieces import MambaFields
from hybridcache.models.core.family_config import attention_problems, param
from hybridcache.models.core.registry import register_family
from hybridcache.models.families.zamba2 import LEGACY_TYPES, MambaResidual, Zamba2LM
from hybridcache.nn import AttentionMixer, GatedMLP, RMSNorm, StepInput
from hybridcache.nn.recurrent.mamba import MambaMixer
from hybridcache.ops import selective_state_update
from hybridcache.ops.selective_scan_btd import selective_scan_btd


@dataclass(kw_only=True)
class ZambaConfig(MambaFields):
    """HF ZambaConfig (transformers 5) fields the model reads, with HF defaults (the Mamba ones in MambaFields)."""

    family: ClassVar[str] = "zamba"
    num_mem_blocks: ClassVar[int] = 1  # Zamba2's skeleton: one shared block, no rotary embedding
    use_mem_rope: ClassVar[bool] = False
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    intermediate_size: int = param(14848, positive=True)
    hidden_act: str = "gelu"
    hidden_mamba_act: str = param("silu", choices=("silu", "swish"))
    num_attention_heads: int = param(16, positive=True)
    num_key_value_heads: int = param(16, positive=True)
    attention_head_dim: int | None = param(None, positive=True, aliases=("head_dim",))  # None: 2 * hidden / heads
    rms_norm_eps: float = param(1e-5, positive=True)
    max_position_embeddings: int = param(4096, positive=True)
    attn_layer_period: int = param(6, positive=True)
    attn_layer_offset: int = param(4, nonnegative=True)
    layers_block_type: list[str] | None = param(None, choices=("linear_attention", "hybrid", "mamba"))
    n_mamba_heads: int = param(2, positive=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.attention_head_dim = self.attention_head_dim or 2 * self.hidden_size // self.num_attention_heads

    @property
    def block_types(self) -> list[str]:
        """ "linear_attention" (Mamba) or "hybrid" per layer; HF's plan from the period and offset by default."""
        if self.layers_block_type is None:
            rest = range(self.num_hidden_layers - 3)
            hybrid = [i % self.attn_layer_period == self.attn_layer_offset for i in rest]
            return ["linear_attention"] * 2 + ["hybrid"] + ["hybrid" if h else "linear_attention" for h in hybrid]
        return [LEGACY_TYPES.get(t, t) for t in self.layers_block_type]

    def problems(self) -> list[str]:
        out = super().problems() + attention_problems(self)
        if len(self.block_types) != self.num_hidden_layers:
            out.append(f"layers_block_type has {len(self.block_types)} entries, not num_hidden_layers")
        if self.mamba_intermediate % self.n_mamba_heads:
            out.append(f"n_mamba_heads ({self.n_mamba_heads}) must divide mamba_expand * hidden_size")
        return out


class ZambaMambaMixer(MambaMixer):
    """Mamba v1 over `heads` channel groups (HF names: x_proj_weight [H, R + 2N, Dh], dt_proj_weight [H, Dh, R],
    dt_proj_bias, A_log [H, Dh, N], D [H, Dh]); each group scans with its own B and C."""

    def __init__(self, cfg: ZambaConfig) -> None:
        di, n, r, heads = cfg.mamba_intermediate, cfg.mamba_d_state, cfg.mamba_rank, cfg.n_mamba_heads
        kw = {"conv_bias": cfg.mamba_conv_bias, "proj_bias": cfg.mamba_proj_bias, "activation": cfg.hidden_mamba_act}
        super().__init__(cfg.hidden_size, di, n, cfg.mamba_d_conv, r, **kw)
        del self.x_proj, self.dt_proj  # per head below
        self.heads, dh = heads, di // heads
        self.x_proj_weight = nn.Parameter(torch.zeros(heads, r + 2 * n, dh))
        self.dt_proj_weight = nn.Parameter(torch.zeros(heads, dh, r))
        self.dt_proj_bias = nn.Parameter(torch.zeros(heads, dh))
        self.A_log = nn.Parameter(self.A_log.detach().reshape(heads, dh, n))
        self.D = nn.Parameter(torch.ones(heads, dh))

    def _project_in(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xz = self.in_proj(h).unflatten(-1, (-1, 2))  # [B, T, Di, 2]: x and gate interleaved
        return xz[..., 0], xz[..., 1]

    def _ssm_inputs(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = torch.einsum("bthd,hkd->bthk", u.unflatten(-1, (self.heads, -1)), self.x_proj_weight)  # [B, T, H, R+2N]
        dt, b, c = p.split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        return torch.einsum("bthr,hdr->bthd", dt, self.dt_proj_weight).flatten(2), b, c  # [B,T,Di], [B,T,H,N] x2

    def _per_head(self, op, state, u, delta, a, b, c, z):
        """`op` (scan or step) per head: its channels of u, delta, z and state, its A, D, bias, B and C."""
        cols = [v.chunk(self.heads, dim=-1) for v in (u, delta, z)] + [state.chunk(self.heads, dim=1)]
        bias = self.dt_proj_bias
        outs = [
            op(sk, uk, dk, a[k], b.select(-2, k), c.select(-2, k), self.D[k], zk, bias[k], delta_softplus=True)
            for k, (uk, dk, zk, sk) in enumerate(zip(*cols))
        ]
        return torch.cat([y for y, _ in outs], dim=-1), torch.cat([s for _, s in outs], dim=1)

    def _scan(self, u, delta, a, b, c, z, state):  # [B, T, Di] inputs, b and c [B, T, H, N]
        return self._per_head(lambda s, *w, **kw: selective_scan_btd(*w, **kw, state=s), state, u, delta, a, b, c, z)

    def _step(self, state, u, delta, a, b, c, z):  # [B, Di] inputs, b and c [B, H, N]
        return self._per_head(selective_state_update, state, u, delta, a, b, c, z)


register_accel(ZambaMambaMixer, mamba_groups_accel(ZambaMambaMixer))  # its decode step in one C call


class ZambaSharedBlock(nn.Module):
    """HF `ZambaAttentionDecoderLayer`: attention over norm([h | e]) (scale (head_dim / 2)^-0.5, no rotary), then
    pre_ff_layernorm and the gated MLP (no inner residuals). One block serves every hybrid layer."""

    def __init__(self, cfg: ZambaConfig) -> None:
        super().__init__()
        d2, hd = 2 * cfg.hidden_size, cfg.attention_head_dim
        self.input_layernorm = RMSNorm(d2, cfg.rms_norm_eps)
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.self_attn = AttentionMixer(d2, heads, kv, hd, scale=(hd / 2) ** -0.5, out_hidden=cfg.hidden_size)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, he: torch.Tensor, use: int, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, 2D]
        y = self.self_attn(self.input_layernorm(he), layer, step)  # [B, T, D]
        return self.feed_forward(self.pre_ff_layernorm(y))


@register_family("zamba")
class ZambaLM(Zamba2LM):
    family = "zamba"
    config_class = ZambaConfig
    shared_name = "shared_transf"

    def make_block(self, block_id: int, uses: int, rotary: None) -> ZambaSharedBlock:
        return ZambaSharedBlock(self.cfg)

    def make_mamba(self) -> MambaResidual:
        return MambaResidual(self.cfg.hidden_size, self.cfg.rms_norm_eps, ZambaMambaMixer(self.cfg))

    def native_mamba(self) -> NativeLayer:
        return NativeLayer("mamba", {**self.cfg.mamba_cache_params(), "dtype": self.dtype})
