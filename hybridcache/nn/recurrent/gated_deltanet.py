"""Gated DeltaNet mixer (Qwen3-Next's linear attention, HF parameter names): in_proj_qkvz / in_proj_ba -> short
causal conv over q, k, v -> gated delta rule (L2-normalised q, k) -> per-head RMSNorm gated by z -> out_proj.

Its conv and delta-rule states live only in its `gated_delta` cache layer: every block starts from
`layer.states` and writes both back, so a sequence fed in any split gives the same result. Left padding leaves
both untouched: the conv input and output are zeroed there, and beta = 0, g = 0 make the delta rule a no-op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from hybridcache.cache import CacheLayer
from hybridcache.nn.core.common import StepInput
from hybridcache.ops import causal_conv1d, causal_conv1d_step, gated_delta_rule, gated_delta_step


class GatedHeadNorm(nn.Module):
    """HF `Qwen3NextRMSNormGated`: RMS-normalise (float32 at least), scale by weight in the input dtype, then
    multiply by silu(gate) in float32 and cast back."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., D] each
        acc = torch.promote_types(x.dtype, torch.float32)
        h = x.to(acc)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.to(acc))).to(x.dtype)


class GatedDeltaNetMixer(nn.Module):
    """forward(h [B, T, D], layer, step) -> [B, T, D]. Hk key heads of Dk, Hv value heads of Dv (Hv = r * Hk)."""

    beta_scale: float = 1.0  # beta = scale * sigmoid(b); OLMo-Hybrid's negative eigenvalues use 2

    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        eps: float = 1e-6,
        activation: str = "silu",
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_v_heads}) must be a multiple of linear_num_key_heads ({num_k_heads})"
            )
        if activation not in ("silu", "swish"):
            raise ValueError(f"unsupported Gated DeltaNet activation '{activation}' (supported: silu)")
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.chunk_size = chunk_size
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkvz = nn.Linear(hidden, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, padding=conv_kernel - 1, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads, dtype=torch.float32))  # a factory: on meta at loading
        if not self.A_log.is_meta:
            with torch.no_grad():
                self.A_log.copy_(torch.arange(1, num_v_heads + 1, dtype=torch.float32).log())
        self.norm = GatedHeadNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)
        self.accel = None  # hybridcache.accel's fast path for this mixer, once installed

    def _split(self, h: torch.Tensor):
        """q, k [B, T, Hk, Dk], v, z [B, T, Hv, Dv], b, a [B, T, Hv]; HF groups the projections per key head."""
        r = self.hv // self.hk
        qkvz = rearrange(self.in_proj_qkvz(h), "b t (g c) -> b t g c", g=self.hk)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        ba = rearrange(self.in_proj_ba(h), "b t (g c) -> b t g c", g=self.hk)
        b, a = ba.split([r, r], dim=-1)
        heads = lambda x: rearrange(x, "b t g (r d) -> b t (g r) d", r=r)  # noqa: E731
        return q, k, heads(v), heads(z), b.flatten(2), a.flatten(2)

    def _conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0]  # [C, K]

    def _gates(self, b: torch.Tensor, a: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """beta [B, T, Hv] and the log-decay g [B, T, Hv] (a subclass may give one per key channel)."""
        g = -torch.exp(self.A_log.to(acc)) * F.softplus(a.to(acc) + self.dt_bias.to(acc))
        return torch.sigmoid(b.to(acc)) * self.beta_scale, g

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # o, z [B, T, Hv, Dv] -> [B, T, D]
        return self.out_proj(rearrange(self.norm(o, z), "b t h d -> b t (h d)"))

    def forward(self, h: torch.Tensor, layer: CacheLayer, step: StepInput) -> torch.Tensor:  # [B, T, D]
        fast = self.__dict__.get("accel")  # (a subclass may build itself without this __init__)
        if fast is not None:
            out = fast(h, layer, step)  # the fast path (a decode step in one call), where it takes this call
            if out is not None:
                return out
        tokens, dtype = h.shape[1], h.dtype
        q, k, v, z, b, a = self._split(h)
        mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)  # [B, T, C]
        mixed = step.mask_padding(mixed)  # padding never enters the conv state
        mixed_in = mixed  # the conv inputs (what the conv state holds)
        states = layer.states  # conv [B, C, K-1], recurrent [B, Hv, Dk, Dv]
        weight = self._conv_weight()  # [C, K]
        if tokens == 1:
            y, conv_state = causal_conv1d_step(mixed[:, 0], weight, None, states["conv"], "silu")
            mixed = y[:, None]
        else:
            y, conv_state = causal_conv1d(mixed.transpose(1, 2), weight, None, states["conv"], "silu")
            mixed = y.transpose(1, 2)
        mixed = step.mask_padding(mixed)  # [B, T, C]
        q, k, v = mixed.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        q, k = (rearrange(x, "b t (h d) -> b t h d", d=self.dk) for x in (q, k))
        v = rearrange(v, "b t (h d) -> b t h d", d=self.dv)
        acc = torch.promote_types(dtype, torch.float32)
        beta, g = self._gates(b, a, acc)
        beta = step.mask_padding(beta)  # [B, T, Hv]; 0 at padding: no write
        g = step.mask_padding(g)  # log-decay 0 at padding: no forgetting
        state = states["recurrent"]
        m = layer.trail_length(tokens)
        if m > 0:  # rollback on: the last m tokens go through the step path, keeping their states
            from hybridcache.nn.recurrent.trail import conv_trail, stack_trail

            head, outs, trail = tokens - m, [], []
            o, s = gated_delta_rule(
                q[:, :head],
                k[:, :head],
                v[:, :head],
                g[:, :head],
                beta[:, :head],
                self.chunk_size,
                state=state,
                qk_l2norm=True,
            )
            outs.append(o)
            for i in range(head, tokens):
                trail.append(s)
                o, s = gated_delta_step(s, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], qk_l2norm=True)
                outs.append(o[:, None])
            trail = {
                "conv": conv_trail(states["conv"], mixed_in.transpose(1, 2), m).to(states["conv"].dtype),
                "recurrent": stack_trail(trail, state.dtype),
            }
            layer.update(conv=conv_state.to(states["conv"].dtype), recurrent=s.to(state.dtype), trail=trail)
            return self._output(torch.cat(outs, dim=1).to(dtype), z)
        if tokens == 1:
            o, new_state = gated_delta_step(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], qk_l2norm=True)
            o = o[:, None]
        else:
            o, new_state = gated_delta_rule(q, k, v, g, beta, self.chunk_size, state=state, qk_l2norm=True)
        layer.update(conv=conv_state.to(states["conv"].dtype), recurrent=new_state.to(state.dtype))
        return self._output(o.to(dtype), z)  # [B, T, D]
