"""Kimi Delta Attention (KDA, Kimi Linear's linear attention; HF parameter names): separate q/k/v projections, each
through its own short causal conv (silu), a gated delta rule whose decay is per key channel (low-rank forget gate
f_b(f_a(h)) + dt_bias, softplus, times -exp(A_log) per head), beta = sigmoid(b_proj(h)), then a per-head RMSNorm gated
by sigmoid(g_b(g_a(h))) and o_proj.

It is Gated DeltaNet's mixer with other projections and gates: the conv + delta-rule states, the cache layer
(`gated_delta`: conv over [q | k | v] channels, state [H, Dk, Dv] with Hk = Hv = H) and the block / step / trail
paths are that mixer's (gated_deltanet.py); the op takes the per-channel decay (ops/gated_delta.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.nn.recurrent.gated_deltanet import GatedDeltaNetMixer, GatedHeadNorm


class SigmoidGatedHeadNorm(GatedHeadNorm):
    """HF `KimiLinearRMSNormGated`: RMS-normalise and scale by the weight in float32, times sigmoid(gate)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., D] each
        acc = torch.promote_types(x.dtype, torch.float32)
        h = x.to(acc)
        h = self.weight.to(acc) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return (h * torch.sigmoid(gate.to(acc))).to(x.dtype)


class KimiDeltaAttention(GatedDeltaNetMixer):
    """forward(h [B, T, D], layer, step) -> [B, T, D]; H heads of size Dk = Dv = head_dim."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, conv_kernel: int = 4, eps: float = 1e-6) -> None:
        nn.Module.__init__(self)
        self.hk = self.hv = num_heads
        self.dk = self.dv = head_dim
        self.chunk_size = 64
        width = num_heads * head_dim
        self.conv_dim = 3 * width
        for name in ("q", "k", "v"):
            self.add_module(f"{name}_proj", nn.Linear(hidden, width, bias=False))
            conv = nn.Conv1d(width, width, conv_kernel, groups=width, padding=conv_kernel - 1, bias=False)
            self.add_module(f"{name}_conv1d", conv)
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)  # forget gate, low rank
        self.f_b_proj = nn.Linear(head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))
        self.b_proj = nn.Linear(hidden, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)  # output gate, low rank
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_norm = SigmoidGatedHeadNorm(head_dim, eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def _split(self, h: torch.Tensor):
        """q, k, v, z (output gate) [B, T, H, D], b [B, T, H], a (forget-gate logits) [B, T, H * D]."""
        heads = (self.hv, self.dv)
        q, k, v = (proj(h).unflatten(-1, heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        z = self.g_b_proj(self.g_a_proj(h)).unflatten(-1, heads)
        return q, k, v, z, self.b_proj(h), self.f_b_proj(self.f_a_proj(h))

    def _conv_weight(self) -> torch.Tensor:  # [3 * H * D, K]: the [q | k | v] channels of the conv state
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]

    def _gates(self, b: torch.Tensor, a: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """beta [B, T, H] and the log-decay per key channel g [B, T, H, Dk]."""
        a = (a.to(acc) + self.dt_bias.to(acc)).unflatten(-1, (self.hv, self.dk))
        return torch.sigmoid(b.to(acc)), -torch.exp(self.A_log.to(acc)[0, 0]) * F.softplus(a)

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] each -> [B, T, hidden]
        return self.o_proj(self.o_norm(o, z).flatten(2))


class BailingDeltaAttention(KimiDeltaAttention):
    """Bailing-hybrid (Ling 3) KDA: a full-rank forget gate f_proj with A_log per head [H], optionally the "safe"
    bounded log-decay lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) (else Kimi's -exp(A_log) * softplus), and
    a full-rank output gate g_proj. Same convs, delta rule and cache as KDA."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, conv_kernel: int, eps: float, **gate) -> None:
        super().__init__(hidden, num_heads, head_dim, conv_kernel, eps)
        del self.f_a_proj, self.f_b_proj, self.g_a_proj, self.g_b_proj
        width = num_heads * head_dim
        self.f_proj = nn.Linear(hidden, width, bias=False)
        self.g_proj = nn.Linear(hidden, width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.safe_gate, self.lower_bound = gate.get("safe_gate", True), gate.get("lower_bound", -5.0)

    def _split(self, h: torch.Tensor):
        heads = (self.hv, self.dv)
        q, k, v = (proj(h).unflatten(-1, heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return q, k, v, self.g_proj(h).unflatten(-1, heads), self.b_proj(h), self.f_proj(h)

    def _gates(self, b: torch.Tensor, a: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        a = (a.to(acc) + self.dt_bias.to(acc)).unflatten(-1, (self.hv, self.dk))  # [B, T, H, Dk]
        rate = torch.exp(self.A_log.to(acc))[:, None]  # [H, 1]
        g = self.lower_bound * torch.sigmoid(rate * a) if self.safe_gate else -rate * F.softplus(a)
        return torch.sigmoid(b.to(acc)), g
